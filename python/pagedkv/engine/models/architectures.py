"""Which transformers architectures the engine implements, and the architecture check at load.

The engine runs its own forward pass (:mod:`pagedkv.engine.models.model` for the Llama family,
:mod:`pagedkv.engine.models.gemma3` for Gemma 3, :mod:`pagedkv.engine.models.nemotron_h` for
Nemotron-H) on weights taken from transformers' model. A model of
another architecture often has weights of the same names (Gemma 3's ``q_proj``,
``input_layernorm``... are Llama's), so without a check it would load and generate garbage;
:func:`build_model` refuses it, naming the architecture, before anything is allocated.

The architecture is the class transformers loaded (``type(hf_model).__name__``), which is what
decides the weights' meaning: a GGUF file's config names no architecture, and a headless
``LlamaModel`` must not pass for a causal LM.
"""

from __future__ import annotations

from typing import Any

from ..errors import EngineConfigError
from .gemma3 import Gemma3ForCausalLM
from .model import LlamaForCausalLM, PagedCausalLM
from .nemotron_h import NemotronHForCausalLM

__all__ = ["MODEL_CLASSES", "architecture_of", "build_model"]

#: transformers class name -> the engine's model. Mistral and Qwen2 are Llama's math (Qwen2 adds
#: q/k/v biases; both may have sliding-window layers, see :mod:`pagedkv.engine.kv_groups`).
#: Nemotron-H is a state-space hybrid (Mamba-2 layers whose recurrent states live in state groups).
MODEL_CLASSES: dict[str, type[LlamaForCausalLM] | type[Gemma3ForCausalLM] | type[NemotronHForCausalLM]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
    "NemotronHForCausalLM": NemotronHForCausalLM,
}


def architecture_of(hf_model: Any) -> str:
    """The architecture name of a loaded transformers model: its class name."""
    return type(hf_model).__name__


def build_model(hf_model: Any, *, device: Any, dtype: Any) -> PagedCausalLM:
    """The engine's model for a loaded transformers causal LM (weights shared when device and
    dtype match).

    Raises:
        EngineConfigError: the architecture is not one of :data:`MODEL_CLASSES` (the message
            names it, the config's ``model_type`` and the supported ones), or a configuration
            of a supported one the engine does not implement (a layer attention type, Gemma 3's
            attention soft-capping...).
    """
    arch = architecture_of(hf_model)
    cls = MODEL_CLASSES.get(arch)
    if cls is None:
        model_type = getattr(getattr(hf_model, "config", None), "model_type", None)
        raise EngineConfigError(
            f"model architecture {arch!r} (model_type {model_type!r}) is not implemented by the "
            f"engine; supported: {', '.join(sorted(MODEL_CLASSES))}"
        )
    return cls.from_hf(hf_model, device=device, dtype=dtype)
