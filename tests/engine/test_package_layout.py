"""The engine package's layout: the model code in ``pagedkv.engine.models`` imports one way
(identity on the loader, never back), the loader's former import path still works, and
``EngineConfig`` is built from keyword arguments only, each one an ``LLMEngine`` argument."""

from __future__ import annotations

import ast
import dataclasses
import inspect
from pathlib import Path

import pytest

import pagedkv.engine.models.identity as identity
import pagedkv.engine.models.loader as loader
from pagedkv.engine import EngineConfig, LLMEngine

MODELS = Path(loader.__file__).resolve().parent


def _imported_modules(path: Path) -> set[str]:
    """Modules a source file imports, relative ones as written (``.identity``), at any depth
    (a function-level import closes a circle as surely as a top-level one)."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom):
            base = "." * node.level + (node.module or "")
            out.add(base)
            out.update(f"{base}.{a.name}" if node.module else f"{base}{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
    return out


def test_loader_never_imports_identity_and_identity_imports_the_loader():
    names = _imported_modules(MODELS / "loader.py")
    assert not {n for n in names if n.endswith("identity")}, names
    assert ".loader" in _imported_modules(MODELS / "identity.py")
    # the file version both caches key on lives in the loader; identity uses that same function
    assert identity.file_version is loader.file_version


def test_the_loaders_former_import_path_still_works():
    from pagedkv.engine.loader import default_model_path, load_hf_model, model_folder, resolve_model_path

    assert model_folder is loader.model_folder and load_hf_model is loader.load_hf_model
    assert resolve_model_path is loader.resolve_model_path and default_model_path is loader.default_model_path


def test_engine_config_fields_are_keyword_only():
    assert all(f.kw_only for f in dataclasses.fields(EngineConfig))
    with pytest.raises(TypeError):
        EngineConfig(64)  # type: ignore[misc]
    assert EngineConfig(num_kv_blocks=64, block_size=8).block_size == 8


def test_every_engine_config_field_is_an_llm_engine_keyword_with_the_same_default():
    params = inspect.signature(LLMEngine.__init__).parameters
    for f in dataclasses.fields(EngineConfig):
        p = params[f.name]
        assert p.kind is inspect.Parameter.KEYWORD_ONLY, f.name
        assert p.default == f.default, f.name


@pytest.mark.parametrize("seed", [2**64, -(2**63) - 1, 10**30])
def test_engine_config_refuses_a_seed_torch_cannot_take(seed: int) -> None:
    # LLMEngine seeds a torch.Generator with it after the model loads: a seed outside 64 bits
    # must be refused with the config, before anything is loaded.
    from pagedkv.engine import EngineConfigError

    with pytest.raises(EngineConfigError, match="seed"):
        EngineConfig(seed=seed)


@pytest.mark.parametrize("seed", [0, -1, -(2**63), 2**63, 2**64 - 1])
def test_engine_config_takes_every_seed_torch_takes(seed: int) -> None:
    import torch

    assert EngineConfig(seed=seed).seed == seed
    torch.Generator().manual_seed(seed)
