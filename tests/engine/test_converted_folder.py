"""The folder a GGUF conversion writes is a plain model folder other loaders read as the same
model: ``config.json`` names the architecture, and a tied embedding is stored under the input
embedding's name (``model.embed_tokens.weight``), not only as ``lm_head.weight``. vLLM read the
older layout (``"architectures": null``, the head's name only) as a headless ``LlamaModel`` with
an unset embedding and generated ``<|endoftext|>`` from uniform logits for every prompt.

The conversion runs for real (``_convert_gguf``, its config and weight writing) on a small
random Llama built in memory the way transformers builds a GGUF model (its config names no
architecture); only the GGUF parsing is replaced. The ``slow`` test checks the real SmolLM2
conversion the engine tests load.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers.engine import ModelBundle
from safetensors import safe_open

from pagedkv.engine.errors import EngineConfigError
from pagedkv.engine.models import loader
from pagedkv.engine.models.loader import ModelSource


def _gguf_like_model(tie: bool) -> Any:
    """A random Llama as transformers returns it from a GGUF file: fp32, eval mode, a config
    without ``architectures``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=tie,
        bos_token_id=2,
        eos_token_id=1,
    )
    torch.manual_seed(7)
    model = LlamaForCausalLM(cfg).float().eval()
    assert model.config.architectures is None  # what a GGUF-made config holds
    return model


def _convert(tmp_path: Path, model: Any, tokenizer: Any, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Runs ``_convert_gguf`` with ``model`` / ``tokenizer`` standing in for the parsed GGUF."""
    from transformers import AutoModelForCausalLM

    gguf = tmp_path / "src" / "model.gguf"
    gguf.parent.mkdir()
    gguf.write_bytes(b"GGUF")
    monkeypatch.setattr(
        loader, "_from_pretrained", lambda cls, src, **kw: model if cls is AutoModelForCausalLM else tokenizer
    )
    dest = tmp_path / "converted"
    loader._convert_gguf(ModelSource(gguf.parent, gguf.name), dest)
    return dest


def _saved(folder: Path) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    config = json.loads((folder / "config.json").read_text())
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        weights = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 - safe_open is no Mapping
    return config, weights


def _logits(model: Any, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0]


def _reload(folder: Path) -> Any:
    from transformers import AutoModelForCausalLM

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32, local_files_only=True).eval()


def test_tied_embedding_is_stored_under_the_input_embedding_and_the_architecture_named(
    tmp_path: Path, tiny: ModelBundle, monkeypatch: pytest.MonkeyPatch
):
    model = _gguf_like_model(tie=True)
    config, weights = _saved(_convert(tmp_path, model, tiny.tokenizer, monkeypatch))
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["tie_word_embeddings"] is True
    assert "model.embed_tokens.weight" in weights
    assert "lm_head.weight" not in weights  # tied: one copy, the loader ties the head to it
    assert torch.equal(weights["model.embed_tokens.weight"], model.model.embed_tokens.weight)
    # Every other weight is there under its own name, with its value.
    expected = {k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}
    assert sorted(weights) == sorted(expected)
    assert all(torch.equal(weights[k], v) for k, v in expected.items())


def test_untied_head_and_embedding_are_both_stored(tmp_path: Path, tiny: ModelBundle, monkeypatch: pytest.MonkeyPatch):
    model = _gguf_like_model(tie=False)
    config, weights = _saved(_convert(tmp_path, model, tiny.tokenizer, monkeypatch))
    assert config["architectures"] == ["LlamaForCausalLM"] and config["tie_word_embeddings"] is False
    assert torch.equal(weights["lm_head.weight"], model.lm_head.weight)
    assert torch.equal(weights["model.embed_tokens.weight"], model.model.embed_tokens.weight)
    assert not torch.equal(weights["lm_head.weight"], weights["model.embed_tokens.weight"])


@pytest.mark.parametrize("tie", [True, False])
def test_the_converted_folder_reloads_as_the_same_model(
    tmp_path: Path, tiny: ModelBundle, monkeypatch: pytest.MonkeyPatch, tie: bool
):
    model = _gguf_like_model(tie=tie)
    reloaded = _reload(_convert(tmp_path, model, tiny.tokenizer, monkeypatch))
    ids = [5, 17, 300, 42, 9]
    torch.testing.assert_close(_logits(reloaded, ids), _logits(model, ids), rtol=0, atol=0)


def test_a_tie_the_model_does_not_have_is_refused(tmp_path: Path, tiny: ModelBundle, monkeypatch: pytest.MonkeyPatch):
    """A config that says tied over a model whose head is its own weight: storing one of them
    would make the folder another model, so the conversion fails and leaves nothing."""
    model = _gguf_like_model(tie=False)
    model.config.tie_word_embeddings = True
    with pytest.raises(EngineConfigError, match="tie_word_embeddings") as raised:
        _convert(tmp_path, model, tiny.tokenizer, monkeypatch)
    assert isinstance(raised.value, ValueError)
    assert not (tmp_path / "converted").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["src"]  # the temporary folder went too


def test_conversions_of_an_older_format_are_redone_and_pruned(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """A folder the previous format wrote for the same, unchanged GGUF file is not a cache hit
    (the key holds the format) and the next conversion removes it (its record names no format)."""
    monkeypatch.setenv("PAGEDKV_CACHE_DIR", str(tmp_path / "cache"))
    gguf = tmp_path / "src" / "model.gguf"
    gguf.parent.mkdir()
    gguf.write_bytes(b"GGUF")
    src = ModelSource(gguf.parent, gguf.name)
    old = tmp_path / "cache" / "model-00000000000000ff"
    old.mkdir(parents=True)
    (old / "config.json").write_text('{"architectures": null}')
    (old / "model.safetensors").write_bytes(b"lm_head.weight only")
    stamp = loader._source_stamp(gguf)
    stamp.pop("format")  # format 1 recorded path, size and mtime only
    (old / loader._SOURCE_RECORD).write_text(json.dumps(stamp))
    converted: list[Path] = []

    def fake_convert(s: ModelSource, dest: Path) -> None:
        dest.mkdir(parents=True)
        (dest / "model.safetensors").write_bytes(b"new")
        (dest / loader._SOURCE_RECORD).write_text(json.dumps(loader._source_stamp(gguf)))
        converted.append(dest)

    monkeypatch.setattr(loader, "_convert_gguf", fake_convert)
    new = loader._usable_source(src, convert_cache=True).folder
    assert converted == [new] and new != old
    assert sorted((tmp_path / "cache").iterdir()) == [new]
    assert loader._usable_source(src, convert_cache=True).folder == new and converted == [new]
    assert json.loads((new / loader._SOURCE_RECORD).read_text())["format"] == loader.CONVERSION_FORMAT


def test_model_folder_of_a_model_folder_is_that_folder(tiny: ModelBundle, tmp_path: Path):
    assert loader.model_folder(tiny.path) == tiny.path.resolve()
    with pytest.raises(loader.ModelNotFoundError, match="does not exist"):
        loader.model_folder(tmp_path / "nothing")


@pytest.mark.slow
def test_the_converted_smollm2_folder_names_its_architecture_and_embedding(smol: ModelBundle):
    """The real conversion of the default model (the folder the vLLM end-to-end suite serves)."""
    folder = loader.model_folder()
    assert folder.parent == loader._cache_root()
    config, weights = _saved(folder)
    assert config["architectures"] == ["LlamaForCausalLM"] and config["tie_word_embeddings"] is True
    assert "model.embed_tokens.weight" in weights and "lm_head.weight" not in weights
    assert weights["model.embed_tokens.weight"].shape == (49152, 576)
    assert torch.equal(weights["model.embed_tokens.weight"], smol.hf.model.embed_tokens.weight)
