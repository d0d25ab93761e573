"""Helpers of the engine and cluster tests: the tiny random Llama and Gemma 3 model folders,
transformers' greedy oracle and the no-leak check (imported by the test modules and the
conftest.py files)."""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

TINY_VOCAB = 512
#: The sliding window of :func:`tiny_gemma3`'s sliding layers.
TINY_GEMMA3_WINDOW = 8


@dataclass
class ModelBundle:
    """A loaded transformers model, its tokenizer and where it lives on disk."""

    hf: Any
    tokenizer: Any
    path: Path


def _tiny_tokenizer(folder: Path) -> Any:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"w{i}": i for i in range(TINY_VOCAB)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="w0", eos_token="w1", bos_token="w2", pad_token="w0")
    fast.chat_template = "{% for m in messages %}w3 {{ m['content'] }} w4 {% endfor %}w5"
    fast.save_pretrained(str(folder))
    return fast


def build_tiny_model(folder: Path, **config: Any) -> ModelBundle:
    """Create, save and reload the tiny model (see the module docs). ``config`` overrides
    LlamaConfig fields (e.g. ``rope_parameters``); RoPE has no weights, so models differing
    only there have the same weights."""
    from safetensors.torch import save_model
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

    fields: dict[str, Any] = dict(
        vocab_size=TINY_VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        bos_token_id=2,
        eos_token_id=1,
        pad_token_id=0,
        initializer_range=0.25,
    )
    fields.update(config)
    cfg = LlamaConfig(**fields)
    torch.manual_seed(1234)
    model = LlamaForCausalLM(cfg).float().eval()
    folder.mkdir(parents=True, exist_ok=True)
    cfg.save_pretrained(str(folder))
    save_model(model, str(folder / "model.safetensors"))
    _tiny_tokenizer(folder)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hf = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32, local_files_only=True).eval()
        tok = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    return ModelBundle(hf, tok, folder)


def assert_no_leak(engine: Any) -> None:
    """After a run: no block referenced, the whole usable pool free, invariants hold."""
    st = engine.manager.stats()
    assert st.used == 0, st
    assert st.free == st.num_blocks - 1, st
    assert engine.manager.num_sequences == 0
    engine.manager.check_invariants()


def hf_greedy(bundle: ModelBundle, prompt_ids: list[int], max_new_tokens: int, **kw: Any) -> list[int]:
    """transformers' own ``generate`` (greedy, batch 1, no padding): the generated token ids,
    cut after the first EOS."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = bundle.hf.generate(
            torch.tensor([prompt_ids]),
            attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.int64),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=bundle.tokenizer.pad_token_id,
            **kw,
        )
    return out[0, len(prompt_ids) :].tolist()


def tiny_gemma3(folder: Path, **overrides: Any) -> ModelBundle:
    """A tiny random Gemma 3 (layers sliding, full, sliding, sliding; window
    :data:`TINY_GEMMA3_WINDOW`, QK-norm, GeGLU, two RoPE bases) saved to ``folder`` and loaded
    back; ``overrides`` replace Gemma3TextConfig fields."""
    from safetensors.torch import save_model
    from transformers import AutoModelForCausalLM, AutoTokenizer, Gemma3ForCausalLM, Gemma3TextConfig

    fields: dict[str, Any] = dict(
        vocab_size=TINY_VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        query_pre_attn_scalar=24,  # not head_dim: the scale must come from the config
        sliding_window=TINY_GEMMA3_WINDOW,
        layer_types=["sliding_attention", "full_attention", "sliding_attention", "sliding_attention"],
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
            "full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0},
        },
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        bos_token_id=2,
        eos_token_id=1,
        pad_token_id=0,
        initializer_range=0.25,
    )
    fields.update(overrides)
    cfg = Gemma3TextConfig(**fields)
    torch.manual_seed(4321)
    model = Gemma3ForCausalLM(cfg).float().eval()
    with torch.no_grad():  # Gemma's norms start at w = 0 (scale 1): give them values to get wrong
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(-0.5, 0.5)
    folder.mkdir(parents=True, exist_ok=True)
    cfg.save_pretrained(str(folder))
    save_model(model, str(folder / "model.safetensors"))
    _tiny_tokenizer(folder)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hf = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32, local_files_only=True).eval()
        tok = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    return ModelBundle(hf, tok, folder)


#: Layer kinds of :func:`tiny_nemotron_h`: Mamba-2, attention, Mamba-2, MLP (Nemotron-H's names).
TINY_NEMOTRON_H_LAYERS = ("linear_attention", "full_attention", "linear_attention", "mlp")


def tiny_nemotron_h(folder: Path, **overrides: Any) -> ModelBundle:
    """A tiny random Nemotron-H (a state-space hybrid: layers :data:`TINY_NEMOTRON_H_LAYERS`;
    Mamba-2 mixers of 4 heads of 8 channels, 2 groups of 8-dimensional B/C, conv width 4;
    attention of 4 query / 2 KV heads of 16) saved to ``folder`` and loaded back; ``overrides``
    replace NemotronHConfig fields. One Mamba-2 layer's state is 448 fp32 numbers (1792 bytes),
    within one 8-token block of the attention layer's K/V (2048 bytes)."""
    from safetensors.torch import save_model
    from transformers import AutoModelForCausalLM, AutoTokenizer, NemotronHConfig, NemotronHForCausalLM

    fields: dict[str, Any] = dict(
        vocab_size=TINY_VOCAB,
        hidden_size=64,
        layers_block_type=list(TINY_NEMOTRON_H_LAYERS),
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=128,
        mamba_num_heads=4,
        mamba_head_dim=8,
        ssm_state_size=8,
        n_groups=2,
        conv_kernel=4,
        chunk_size=8,
        # transformers clamps the time step below at time_step_min in its multi-token (chunked)
        # scan only, not in its one-token decode; a floor no time step reaches keeps both paths
        # (and the engine's, which always clamps) the same model.
        time_step_min=1e-6,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        bos_token_id=2,
        eos_token_id=1,
        pad_token_id=0,
        initializer_range=0.25,
    )
    fields.update(overrides)
    cfg = NemotronHConfig(**fields)
    torch.manual_seed(2468)
    model = NemotronHForCausalLM(cfg).float().eval()
    with torch.no_grad():  # norms start at 1 and D at 1: give them values to get wrong
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith("norm_f.weight"):
                p.uniform_(0.5, 1.5)
            elif name.endswith(".D"):
                p.uniform_(-1.0, 1.0)
            elif name.endswith(".dt_bias"):  # time steps softplus(dt + bias) of about 0.05 to 1
                p.uniform_(-3.0, 0.0)
    folder.mkdir(parents=True, exist_ok=True)
    cfg.save_pretrained(str(folder))
    save_model(model, str(folder / "model.safetensors"))
    _tiny_tokenizer(folder)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hf = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32, local_files_only=True).eval()
        tok = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    return ModelBundle(hf, tok, folder)
