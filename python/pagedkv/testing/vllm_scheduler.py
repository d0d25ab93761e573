"""Drive vLLM's real V1 Scheduler on CPU with a deterministic fake model (no GPU, no network).

A tiny Llama ``config.json`` is written to a temporary folder; ``VllmConfig`` is built from it
with ``skip_tokenizer_init`` (the scheduler never tokenizes). The KV cache is one
``FullAttentionSpec`` group of ``num_blocks`` blocks. Each step, ``schedule()`` runs, the fake
model samples one token for every request whose scheduled chunk reaches the end of its known
tokens (the token depends only on the request id and its position), and
``update_from_output()`` consumes it. ``Driver.step`` records what one step did in a plain dict
so two schedulers (stock and ``PagedKVScheduler``) can be compared step by step.

Used by the vLLM differential tests, ``benchmarks/vllm_scheduler.py`` and the README example; a
testing helper, not part of the plug-in (``pagedkv.integrations.vllm``). Needs the ``vllm``
extra: without vLLM, importing it raises :class:`pagedkv.MissingDependencyError`.
Importing it sets ``VLLM_LOGGING_LEVEL=ERROR`` and ``VLLM_TARGET_DEVICE=cpu`` unless they are
already set (they only take effect if vLLM was not imported before).
"""

from __future__ import annotations

import json
import math
import os
import tempfile
import zlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

from pagedkv._optional import optional_imports  # noqa: E402

# vLLM first, alone: it brings torch, so a missing vLLM is reported as such.
with optional_imports("pagedkv.testing.vllm_scheduler", "vllm"):
    import vllm  # noqa: F401
with optional_imports("pagedkv.testing.vllm_scheduler", "vllm"):
    import torch
    from vllm.config import (
        CacheConfig,
        DeviceConfig,
        KVEventsConfig,
        LoRAConfig,
        ModelConfig,
        SchedulerConfig,
        SpeculativeConfig,
        VllmConfig,
    )
    from vllm.lora.request import LoRARequest
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.kv_cache_interface import (
        ChunkedLocalAttentionSpec,
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        MambaSpec,
        SlidingWindowSpec,
    )
    from vllm.v1.outputs import DraftTokenIds, ModelRunnerOutput
    from vllm.v1.request import Request, RequestStatus
    from vllm.v1.structured_output import StructuredOutputManager

VOCAB = 4096
EOS = 2
# Fake tokens avoid the special ids below this.
FIRST_TOKEN = 16

_MODEL_DIR: Path | None = None


def tiny_model_dir() -> Path:
    """A folder with a tiny Llama ``config.json`` (written once per process)."""
    global _MODEL_DIR
    if _MODEL_DIR is None:
        d = Path(tempfile.mkdtemp(prefix="pagedkv-vllm-model-"))
        config = {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "num_hidden_layers": 2,
            "vocab_size": VOCAB,
            "max_position_embeddings": 131072,
            "rms_norm_eps": 1e-5,
            "bos_token_id": 1,
            "eos_token_id": EOS,
            "torch_dtype": "float32",
            "tie_word_embeddings": True,
        }
        (d / "config.json").write_text(json.dumps(config))
        _MODEL_DIR = d
    return _MODEL_DIR


#: Gemma 3's attention pattern in :func:`tiny_gemma3_model_dir`: 18 layers, every sixth full
#: attention (layers 5, 11, 17), the others a sliding window of ``GEMMA3_WINDOW`` tokens.
GEMMA3_NUM_LAYERS = 18
GEMMA3_WINDOW = 512

_GEMMA3_DIR: Path | None = None


def tiny_gemma3_model_dir() -> Path:
    """A folder with a tiny Gemma 3 text ``config.json`` (``Gemma3ForCausalLM``, written once
    per process by transformers' ``Gemma3TextConfig.save_pretrained``, offline): Gemma 3 270M's
    layer pattern (:data:`GEMMA3_NUM_LAYERS` layers, every sixth full attention, the others a
    sliding window of :data:`GEMMA3_WINDOW` tokens, one KV head of 16), a 4096-token vocabulary.
    No weights: for vLLM's config and engine core without a model."""
    global _GEMMA3_DIR
    if _GEMMA3_DIR is None:
        from transformers import Gemma3TextConfig

        d = Path(tempfile.mkdtemp(prefix="pagedkv-vllm-gemma3-"))
        layer_types = ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(GEMMA3_NUM_LAYERS)]
        config = Gemma3TextConfig(
            vocab_size=VOCAB,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=GEMMA3_NUM_LAYERS,
            num_attention_heads=4,
            num_key_value_heads=1,
            head_dim=16,
            sliding_window=GEMMA3_WINDOW,
            layer_types=layer_types,
            max_position_embeddings=131072,
            bos_token_id=1,
            eos_token_id=EOS,
            pad_token_id=0,
        )
        config.architectures = ["Gemma3ForCausalLM"]
        config.save_pretrained(str(d))
        _GEMMA3_DIR = d
    return _GEMMA3_DIR


def make_vllm_config(
    *,
    num_blocks: int,
    block_size: int = 16,
    max_num_seqs: int = 64,
    max_num_batched_tokens: int = 512,
    max_model_len: int = 4096,
    enable_prefix_caching: bool = True,
    long_prefill_token_threshold: int = 0,
    kv_events: bool = False,
    max_loras: int = 0,
    scheduler_cls: Any = None,
    policy: str = "fcfs",
    watermark: float = 0.0,
    model_dir: Path | None = None,
    async_scheduling: bool = False,
    **overrides: Any,
) -> VllmConfig:
    """A ``VllmConfig`` for the tiny local model (``model_dir``, default
    :func:`tiny_model_dir`'s Llama), CPU device, ``num_blocks`` KV blocks; ``async_scheduling``
    is ``scheduler_config.async_scheduling`` (drive such a scheduler with
    :class:`AsyncDriver`)."""
    model_config = ModelConfig(
        model=str(model_dir or tiny_model_dir()),
        skip_tokenizer_init=True,
        max_model_len=max_model_len,
        dtype="float32",
        seed=0,
    )
    cache_config = CacheConfig(
        block_size=block_size,
        enable_prefix_caching=enable_prefix_caching,
    )
    cache_config.num_gpu_blocks = num_blocks
    scheduler_config = SchedulerConfig(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=max_model_len,
        long_prefill_token_threshold=long_prefill_token_threshold,
        enable_chunked_prefill=True,
        is_encoder_decoder=False,
        async_scheduling=async_scheduling,
        scheduler_cls=scheduler_cls,
        policy=policy,
        watermark=watermark,
    )
    kwargs: dict[str, Any] = dict(
        model_config=model_config,
        cache_config=cache_config,
        scheduler_config=scheduler_config,
        device_config=DeviceConfig(device="cpu"),
    )
    if kv_events:
        kwargs["kv_events_config"] = KVEventsConfig(enable_kv_cache_events=True, publisher="null")
    if max_loras:
        kwargs["lora_config"] = LoRAConfig(max_loras=max_loras, max_lora_rank=8)
    kwargs.update(overrides)
    config = VllmConfig(**kwargs)
    if async_scheduling:
        # vLLM's CPU platform turns async scheduling off while the config is built; the harness
        # stands for a GPU machine, where it stays on.
        config.scheduler_config.async_scheduling = True
    return config


def ngram_speculative_config(vllm_config: VllmConfig, num_speculative_tokens: int) -> SpeculativeConfig:
    """An n-gram (prompt lookup) ``SpeculativeConfig`` of ``num_speculative_tokens`` drafts for
    ``vllm_config``'s model; pass it as ``make_vllm_config(..., speculative_config=...)``. The
    drafts themselves come from :func:`fake_drafts` (the harness runs no proposer)."""
    return SpeculativeConfig(
        method="ngram",
        num_speculative_tokens=num_speculative_tokens,
        prompt_lookup_max=3,
        prompt_lookup_min=1,
        target_model_config=vllm_config.model_config,
        target_parallel_config=vllm_config.parallel_config,
    )


def eagle_speculative_config(
    vllm_config: VllmConfig,
    num_speculative_tokens: int,
    method: str = "eagle",
    *,
    lookahead_block_hashes: bool = False,
) -> SpeculativeConfig:
    """A ``SpeculativeConfig`` that the scheduler reads as a model-based drafter's: ``method``
    (``"eagle"``, ``"eagle3"`` or ``"mtp"``) with ``num_speculative_tokens`` drafts, so
    ``vllm_config.num_lookahead_tokens == num_speculative_tokens`` and
    ``num_prefill_lookahead_tokens == 1``; with ``lookahead_block_hashes`` off (default)
    ``disable_lookahead_block_hashes`` is set, so vLLM drops the last block of prefix hits
    (``use_eagle_block_drop``). No draft model is loaded (the harness runs no proposer: the
    config is an n-gram one with its ``method`` set; drafts come from :func:`fake_drafts`)."""
    config = ngram_speculative_config(vllm_config, num_speculative_tokens)
    object.__setattr__(config, "method", method)
    object.__setattr__(config, "disable_lookahead_block_hashes", not lookahead_block_hashes)
    return config


def fake_drafts(request_id: str, position: int, k: int) -> list[int]:
    """``k`` deterministic draft tokens for positions ``position ..``: the fake model's own
    token (so it is accepted) unless the position's hash says otherwise (about one in three
    is wrong, so acceptance stops there)."""
    out = []
    for p in range(position, position + k):
        t = fake_token(request_id, p)
        wrong = zlib.crc32(f"draft:{request_id}@{p}".encode()) % 3 == 0
        out.append(FIRST_TOKEN + (t - FIRST_TOKEN + 1) % (VOCAB - FIRST_TOKEN) if wrong else t)
    return out


def make_kv_cache_config(num_blocks: int, block_size: int = 16) -> KVCacheConfig:
    """One full-attention KV cache group of ``num_blocks`` blocks (tensor shape irrelevant)."""
    spec = FullAttentionSpec(block_size=block_size, num_kv_heads=1, head_size=1, dtype=torch.float32)
    return KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(["layers.0.self_attn"], spec)],
    )


#: Gemma 3's layer pattern as KV cache groups: one full-attention group and five sliding-window
#: groups (window 512), as vLLM groups its 1-in-6 full layers.
GEMMA3_GROUPS: tuple[tuple[str, int | None], ...] = (("full", None),) + (("sliding_window", 512),) * 5


def make_hybrid_kv_cache_config(
    num_blocks: int,
    groups: Sequence[tuple[Any, ...]],
    block_size: int = 16,
    *,
    layers_per_group: int = 3,
    retention_interval: int | None = None,
) -> KVCacheConfig:
    """A hybrid ``KVCacheConfig``: one group per ``(kind, span)`` or ``(kind, span,
    group_block_size)`` of ``groups`` (kind ``"full"`` (span None), ``"sliding_window"`` (span =
    window) or ``"chunked_local"`` (span = chunk); the group's block size in tokens defaults to
    ``block_size``), ``layers_per_group`` layers each, one pool of ``num_blocks`` equal pages
    (a group of a smaller block size has proportionally larger heads, as vLLM's page-size
    unification gives it). ``retention_interval`` is vLLM's ``prefix_cache_retention_interval``
    (None: dense)."""
    sizes = [int(g[2]) if len(g) > 2 else block_size for g in groups]
    page = math.lcm(*sizes)
    out = []
    layer = 0
    for (kind, span, *_), bs in zip(groups, sizes, strict=True):
        kw: dict[str, Any] = dict(block_size=bs, num_kv_heads=1, head_size=page // bs, dtype=torch.float32)
        if kind == "full":
            spec: Any = FullAttentionSpec(**kw)
        elif kind == "sliding_window":
            spec = SlidingWindowSpec(sliding_window=span, **kw)
        elif kind == "chunked_local":
            spec = ChunkedLocalAttentionSpec(attention_chunk_size=span, **kw)
        else:
            raise ValueError(f"unknown group kind {kind!r}")
        names = [f"layers.{layer + i}.self_attn" for i in range(layers_per_group)]
        layer += layers_per_group
        out.append(KVCacheGroupSpec(names, spec))
    config = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=out)
    config.prefix_cache_retention_interval = retention_interval
    return config


#: Qwen3-Next's layer pattern (Gated DeltaNet linear attention : full attention = 3 : 1) as
#: vLLM groups it: three GDN state groups and one full-attention group.
QWEN3_NEXT_GROUPS: tuple[str, ...] = ("gdn", "gdn", "gdn", "full")
#: Nemotron-H / Granite-4.0-H: Mamba-2 layers with a few full-attention layers (two Mamba-2
#: state groups and one full-attention group).
NEMOTRON_H_GROUPS: tuple[str, ...] = ("mamba2", "mamba2", "full")


def make_mamba_kv_cache_config(
    num_blocks: int,
    groups: Sequence[str],
    block_size: int = 16,
    *,
    mamba_cache_mode: str = "align",
    layers_per_group: int = 2,
    num_speculative_blocks: int = 0,
    num_prefill_checkpoint_blocks: int = 0,
    mamba_block_size: int | None = None,
) -> KVCacheConfig:
    """A hybrid ``KVCacheConfig`` with Mamba layers: one group per entry of ``groups``
    (``"full"``: full attention; ``"mamba2"`` / ``"gdn"``: a ``MambaSpec`` of that backend in
    ``mamba_cache_mode``), every group at ``block_size`` tokens per block (vLLM's align mode
    gives Mamba groups the attention block size; ``mamba_block_size``, if given, is the Mamba
    groups' instead: vLLM's mode ``"none"`` uses the context length), the state page padded
    to the attention page, one pool of ``num_blocks`` pages. Tensor shapes are placeholders."""
    from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum

    full = FullAttentionSpec(block_size=block_size, num_kv_heads=1, head_size=4, dtype=torch.float32)
    backends = {"mamba2": MambaAttentionBackendEnum.MAMBA2, "gdn": MambaAttentionBackendEnum.GDN_ATTN}
    out = []
    layer = 0
    for kind in groups:
        names = [f"layers.{layer + i}" for i in range(layers_per_group)]
        layer += layers_per_group
        if kind == "full":
            out.append(KVCacheGroupSpec([f"{n}.self_attn" for n in names], full))
            continue
        spec = MambaSpec(
            block_size=block_size if mamba_block_size is None else mamba_block_size,
            shapes=((3, 4), (2, 4)),
            dtypes=(torch.float32, torch.float32),
            page_size_padded=full.page_size_bytes,
            mamba_type=backends[kind],
            mamba_cache_mode=mamba_cache_mode,
            num_speculative_blocks=num_speculative_blocks,
            num_prefill_checkpoint_blocks=num_prefill_checkpoint_blocks,
        )
        out.append(KVCacheGroupSpec([f"{n}.linear_attn" for n in names], spec))
    return KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=out)


def build_scheduler(
    cls: type,
    vllm_config: VllmConfig,
    *,
    log_stats: bool = True,
    kv_cache_config: KVCacheConfig | None = None,
    block_size: int | None = None,
    hash_block_size: int | None = None,
) -> Any:
    """``cls`` (vLLM's ``Scheduler`` or a subclass) built as the engine core builds it, with
    ``kv_cache_config`` (default: one full-attention group of the config's blocks).
    ``block_size`` / ``hash_block_size``: the scheduler block size and prefix-hash granularity
    the engine core passes (default: the config's block size, and ``hash_block_size`` left to
    the scheduler's default, the block size)."""
    num_blocks = vllm_config.cache_config.num_gpu_blocks
    if block_size is None:
        block_size = vllm_config.cache_config.block_size
    if kv_cache_config is None:
        kv_cache_config = make_kv_cache_config(num_blocks, block_size)
    extra: dict[str, Any] = {} if hash_block_size is None else {"hash_block_size": hash_block_size}
    return cls(
        vllm_config=vllm_config,
        kv_cache_config=kv_cache_config,
        structured_output_manager=StructuredOutputManager(vllm_config),
        block_size=block_size,
        log_stats=log_stats,
        **extra,
    )


_HASHER: Any = None


def block_hasher(block_size: int, num_hash_lookahead_tokens: int = 0) -> Any:
    """The engine core's per-request block hasher (SHA-256, vLLM's default); with
    ``num_hash_lookahead_tokens`` (vLLM's ``VllmConfig.num_hash_lookahead_tokens``, as the
    engine core passes it) each hash also covers that many tokens after its block."""
    global _HASHER
    if _HASHER is None:
        fn = get_hash_fn_by_name("sha256")
        init_none_hash(fn)
        _HASHER = fn
    if num_hash_lookahead_tokens:
        return get_request_block_hasher(block_size, _HASHER, num_hash_lookahead_tokens)
    return get_request_block_hasher(block_size, _HASHER)


def fake_token(request_id: str, position: int) -> int:
    """The fake model's token for ``request_id`` at ``position``: depends on nothing else."""
    return FIRST_TOKEN + zlib.crc32(f"{request_id}@{position}".encode()) % (VOCAB - FIRST_TOKEN)


def make_request(
    request_id: str,
    prompt: Sequence[int],
    max_tokens: int,
    *,
    block_size: int = 16,
    cache_salt: str | None = None,
    lora: tuple[str, int] | None = None,
    stop_token_ids: Sequence[int] = (),
    priority: int = 0,
    arrival_time: float | None = None,
    num_hash_lookahead_tokens: int = 0,
) -> Request:
    """A vLLM ``Request`` as the engine core makes it (block hashes included, covering
    ``num_hash_lookahead_tokens`` tokens after each block: pass the config's
    ``num_hash_lookahead_tokens``, as the engine core does)."""
    params = SamplingParams(max_tokens=max_tokens, stop_token_ids=list(stop_token_ids), ignore_eos=False)
    params.update_from_generation_config({}, EOS)
    lora_request = (
        LoRARequest(lora_name=lora[0], lora_int_id=lora[1], lora_path=f"/nonexistent/{lora[0]}") if lora else None
    )
    return Request(
        request_id=request_id,
        prompt_token_ids=list(prompt),
        sampling_params=params,
        pooling_params=None,
        arrival_time=arrival_time,
        lora_request=lora_request,
        cache_salt=cache_salt,
        priority=priority,
        block_hasher=block_hasher(block_size, num_hash_lookahead_tokens),
    )


def fake_model_output(scheduler: Any, sched_output: Any) -> ModelRunnerOutput:
    """What the fake model returns for ``sched_output``: one token for each request whose
    scheduled tokens reach its known length (a finished prefill or a decode), none for a
    partial prefill chunk. A verify step (speculative decoding) samples as a greedy verifier:
    each draft equal to the model's token at its position is accepted, the first other one
    is replaced by the model's token, and all accepted give one bonus token, so the output
    tokens are those of decoding without drafts."""
    req_ids = list(sched_output.num_scheduled_tokens)
    spec = sched_output.scheduled_spec_decode_tokens
    sampled: list[list[int]] = []
    for rid in req_ids:
        request = scheduler.requests[rid]
        if request.num_computed_tokens >= request.num_tokens:
            pos = request.num_tokens
            toks = []
            for draft in spec.get(rid, ()):
                toks.append(fake_token(rid, pos))
                if draft != toks[-1]:
                    break
                pos += 1
            else:
                toks.append(fake_token(rid, pos))
            sampled.append(toks)
        else:
            sampled.append([])
    return ModelRunnerOutput(
        req_ids=req_ids,
        req_id_to_index={rid: i for i, rid in enumerate(req_ids)},
        sampled_token_ids=sampled,
        logprobs=None,
        prompt_logprobs_dict={},
        pooler_output=[],
    )


def fake_async_model_output(scheduler: Any, sched_output: Any) -> ModelRunnerOutput:
    """What the fake model returns for ``sched_output`` under async scheduling, computed right
    after ``schedule()`` (the scheduler has advanced ``num_computed_tokens`` over the scheduled
    tokens, and the ids of tokens still in flight are not known): one token, at the request's
    computed count, for each request whose step is not a partial prefill chunk (the same
    tokens as :func:`fake_model_output`; no draft tokens)."""
    req_ids = list(sched_output.num_scheduled_tokens)
    sampled: list[list[int]] = []
    for rid in req_ids:
        request = scheduler.requests[rid]
        sampled.append([] if request.is_prefill_chunk else [fake_token(rid, request.num_computed_tokens)])
    return ModelRunnerOutput(
        req_ids=req_ids,
        req_id_to_index={rid: i for i, rid in enumerate(req_ids)},
        sampled_token_ids=sampled,
        logprobs=None,
        prompt_logprobs_dict={},
        pooler_output=[],
    )


def _held(tables: Sequence[Sequence[int]], per_group: bool) -> Any:
    """A request's block count (one full-attention group) or, per group, its table length and
    the real (non-null) blocks in it (``per_group``: several groups or a windowed one; the null
    block 0 marks a released entry)."""
    if not per_group:
        return len(tables[0])
    return tuple((len(t), sum(1 for b in t if b != 0)) for t in tables)


class Driver:
    """Runs one scheduler step by step and records what each step did."""

    def __init__(self, scheduler: Any, *, num_drafts: int = 0, model_output: Any = None) -> None:
        """``num_drafts`` > 0: after each step every running request gets that many draft
        tokens from :func:`fake_drafts` (``update_draft_token_ids``, as the engine core does
        after a proposer ran); the scheduler needs a ``speculative_config``. ``model_output``
        (``(scheduler, scheduler_output) -> ModelRunnerOutput``, default
        :func:`fake_model_output`) makes each step's output, e.g. with a fake KV connector
        worker's report attached."""
        self.scheduler = scheduler
        self.num_drafts = num_drafts
        self.model_output = model_output
        groups = scheduler.kv_cache_config.kv_cache_groups
        self._per_group = len(groups) > 1 or type(groups[0].kv_cache_spec) is not FullAttentionSpec
        #: Draft tokens scheduled and accepted over the run (speculative decoding).
        self.drafts_scheduled = 0
        self.drafts_accepted = 0
        self.outputs: dict[str, list[int]] = {}
        self.finish_reasons: dict[str, str] = {}
        self.prefix_hits: dict[str, int] = {}
        # Sum of the prefix-cache stats the scheduler reports (with log_stats).
        self.prefix_cache_stats = {"requests": 0, "queries": 0, "hits": 0}

    def add(self, request: Request) -> None:
        """Hand ``request`` to the scheduler (its outputs are recorded from then on)."""
        self.outputs.setdefault(request.request_id, [])
        self.scheduler.add_request(request)

    def abort(self, request_ids: Sequence[str]) -> None:
        """Abort requests through the scheduler (finish reason ``"abort"``)."""
        self.scheduler.finish_requests(list(request_ids), RequestStatus.FINISHED_ABORTED)
        for rid in request_ids:
            self.finish_reasons.setdefault(rid, "abort")

    def step(self) -> dict[str, Any]:
        """One ``schedule()`` + fake model + ``update_from_output()``; returns the record."""
        sched = self.scheduler
        out = sched.schedule()
        new_hits = {r.req_id: r.num_computed_tokens for r in out.scheduled_new_reqs}
        for rid, hit in new_hits.items():
            self.prefix_hits.setdefault(rid, hit)
        cached = out.scheduled_cached_reqs
        # Resumed (preempted) requests: their prefix hit is the computed count they restart at.
        resumed = {
            rid: n for rid, n in zip(cached.req_ids, cached.num_computed_tokens) if rid in cached.resumed_req_ids
        }
        scheduled = dict(out.num_scheduled_tokens)
        blocks_held = {
            rid: _held(sched.kv_cache_manager.get_block_ids(rid), self._per_group) for rid in sorted(scheduled)
        }
        model_out = (self.model_output or fake_model_output)(sched, out)
        for rid, drafts in out.scheduled_spec_decode_tokens.items():
            self.drafts_scheduled += len(drafts)
            self.drafts_accepted += len(model_out.sampled_token_ids[model_out.req_id_to_index[rid]]) - 1
        engine_outputs = sched.update_from_output(out, model_out)
        if self.num_drafts:
            running = [r.request_id for r in sched.running if not r.is_finished()]
            sched.update_draft_token_ids(
                DraftTokenIds(
                    running,
                    [fake_drafts(rid, sched.requests[rid].num_tokens, self.num_drafts) for rid in running],
                )
            )
        new_tokens: dict[str, list[int]] = {}
        finished: dict[str, str] = {}
        for eco in engine_outputs.values():
            stats = getattr(eco, "scheduler_stats", None)
            if stats is not None and stats.prefix_cache_stats is not None:
                for key in self.prefix_cache_stats:
                    self.prefix_cache_stats[key] += getattr(stats.prefix_cache_stats, key)
            for o in eco.outputs:
                if o.new_token_ids:
                    new_tokens[o.request_id] = list(o.new_token_ids)
                    self.outputs.setdefault(o.request_id, []).extend(o.new_token_ids)
                if o.finish_reason is not None:
                    finished[o.request_id] = str(o.finish_reason)
                    self.finish_reasons[o.request_id] = str(o.finish_reason)
        return {
            "scheduled": scheduled,
            "new_prefix_hits": new_hits,
            "resumed": resumed,
            "preempted": sorted(getattr(out, "preempted_req_ids", None) or []),
            "finished": finished,
            "new_tokens": new_tokens,
            "blocks_held": blocks_held,
        }

    def run(self, max_steps: int = 10_000) -> list[dict[str, Any]]:
        """Steps until no request is left (at most ``max_steps``)."""
        records = []
        for _ in range(max_steps):
            if not self.scheduler.has_unfinished_requests():
                break
            records.append(self.step())
        return records


class AsyncDriver(Driver):
    """Runs an async scheduler (vLLM's ``AsyncScheduler`` or ``PagedKVAsyncScheduler``) as the
    engine core's batch queue does with two batches in flight: each :meth:`step` schedules the
    next batch while the previous one is still running, then consumes the oldest batch's
    output (:func:`fake_async_model_output`, taken when its batch was scheduled). A step's
    record holds what was scheduled in it and the outputs consumed in it."""

    #: Batches in flight at most (vLLM's ``max_concurrent_batches`` with async scheduling).
    depth = 2

    def __init__(self, scheduler: Any, *, num_drafts: int = 0) -> None:
        """``num_drafts`` > 0: speculative decoding (the scheduler needs a
        ``speculative_config``): the scheduler schedules placeholder drafts, and a batch's
        output is made when it is consumed, as a verifier that checks :func:`fake_drafts` of
        that many tokens after the request's known tokens (its drafter runs on the device, so
        the scheduler never sees the drafts)."""
        super().__init__(scheduler)
        self.spec_drafts = num_drafts
        self._in_flight: list[tuple[Any, Any]] = []

    def has_work(self) -> bool:
        """Whether a request is unfinished or a batch is still in flight."""
        return bool(self._in_flight) or self.scheduler.has_unfinished_requests()

    def step(self) -> dict[str, Any]:
        """Schedules one batch (if any request is left) and, once ``depth`` batches are in
        flight or nothing more can be scheduled, consumes the oldest one's output."""
        sched = self.scheduler
        record: dict[str, Any] = {
            "scheduled": {},
            "new_prefix_hits": {},
            "resumed": {},
            "preempted": [],
            "finished": {},
            "new_tokens": {},
            "blocks_held": {},
        }
        scheduled_any = False
        if sched.has_unfinished_requests():
            out = sched.schedule()
            scheduled_any = out.total_num_scheduled_tokens > 0
            new_hits = {r.req_id: r.num_computed_tokens for r in out.scheduled_new_reqs}
            for rid, hit in new_hits.items():
                self.prefix_hits.setdefault(rid, hit)
            cached = out.scheduled_cached_reqs
            record["scheduled"] = dict(out.num_scheduled_tokens)
            record["new_prefix_hits"] = new_hits
            record["resumed"] = {
                rid: n for rid, n in zip(cached.req_ids, cached.num_computed_tokens) if rid in cached.resumed_req_ids
            }
            record["preempted"] = sorted(getattr(out, "preempted_req_ids", None) or [])
            record["blocks_held"] = {
                rid: _held(sched.kv_cache_manager.get_block_ids(rid), self._per_group)
                for rid in sorted(out.num_scheduled_tokens)
            }
            if self.spec_drafts:
                # Which requests sample in this batch (a partial prefill chunk does not).
                samples = {rid: not sched.requests[rid].is_prefill_chunk for rid in out.num_scheduled_tokens}
                self._in_flight.append((out, samples))
            else:
                self._in_flight.append((out, fake_async_model_output(sched, out)))
            if len(self._in_flight) < self.depth and (scheduled_any or sched.has_unfinished_requests()):
                return record
        if not self._in_flight:
            return record
        out, model_out = self._in_flight.pop(0)
        if self.spec_drafts:
            model_out = self._verify(out, model_out)
        engine_outputs = sched.update_from_output(out, model_out)
        for eco in engine_outputs.values():
            stats = getattr(eco, "scheduler_stats", None)
            if stats is not None and stats.prefix_cache_stats is not None:
                for key in self.prefix_cache_stats:
                    self.prefix_cache_stats[key] += getattr(stats.prefix_cache_stats, key)
            for o in eco.outputs:
                if o.new_token_ids:
                    record["new_tokens"][o.request_id] = list(o.new_token_ids)
                    self.outputs.setdefault(o.request_id, []).extend(o.new_token_ids)
                if o.finish_reason is not None:
                    record["finished"][o.request_id] = str(o.finish_reason)
                    self.finish_reasons[o.request_id] = str(o.finish_reason)
        return record

    def _verify(self, out: Any, samples: dict[str, bool]) -> ModelRunnerOutput:
        """The output of a batch with placeholder drafts, made when it is consumed: each
        sampling request verifies the drafts after its known tokens as a greedy verifier
        (accepted while equal to the fake model's token, then one more token)."""
        req_ids = list(out.num_scheduled_tokens)
        sampled: list[list[int]] = []
        for rid in req_ids:
            request = self.scheduler.requests.get(rid)
            if request is None or not samples[rid]:
                sampled.append([])
                continue
            k = len(out.scheduled_spec_decode_tokens.get(rid, ()))
            pos = request.num_tokens
            toks = []
            for draft in fake_drafts(rid, pos, k):
                toks.append(fake_token(rid, pos))
                if draft != toks[-1]:
                    break
                pos += 1
            else:
                toks.append(fake_token(rid, pos))
            self.drafts_scheduled += k
            self.drafts_accepted += len(toks) - 1
            sampled.append(toks)
        return ModelRunnerOutput(
            req_ids=req_ids,
            req_id_to_index={rid: i for i, rid in enumerate(req_ids)},
            sampled_token_ids=sampled,
            logprobs=None,
            prompt_logprobs_dict={},
            pooler_output=[],
        )

    def run(self, max_steps: int = 10_000) -> list[dict[str, Any]]:
        """Steps until no request is left and no batch is in flight (at most ``max_steps``)."""
        records = []
        for _ in range(max_steps):
            if not self.has_work():
                break
            records.append(self.step())
        return records
