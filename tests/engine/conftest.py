"""Fixtures of the engine tests.

- ``tiny``: a small random Llama (2 layers, GQA 4/2 heads, vocab 512) saved as a complete model
  folder (config.json + model.safetensors + a word-level tokenizer), loaded once per session.
  Fast enough for CI, and it exercises exactly the same engine code as a real model. Its
  weights use a large init scale so next-token distributions are peaked (no near-ties that
  would make greedy token identity depend on float rounding).
- ``smol``: SmolLM2-135M-Instruct (the default model), for tests marked ``slow``.

Torch runs single-threaded here: on a shared 2-core machine, two OpenMP threads are often an
order of magnitude slower than one.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from helpers.engine import ModelBundle, build_tiny_model  # noqa: E402


@pytest.fixture(scope="session", autouse=True)
def _single_thread():
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


@pytest.fixture(scope="session")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> ModelBundle:
    return build_tiny_model(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def smol() -> ModelBundle:
    from pagedkv.engine.models.loader import default_model_path, load_hf_model

    hf, tok = load_hf_model()
    return ModelBundle(hf, tok, default_model_path())
