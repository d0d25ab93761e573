"""Fixtures of the cluster tests.

- ``tiny``: the engine tests' tiny random Llama (:func:`helpers.engine.build_tiny_model`), built
  once per session; the tests that use it are skipped without torch and transformers, while
  the CLI and error tests here need neither.

Torch runs single-threaded here, as in the engine tests (a shared 2-core machine).
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from typing import Any

import pytest


@pytest.fixture(scope="session", autouse=True)
def _single_thread() -> Iterator[None]:
    torch = sys.modules.get("torch")  # only where a test imported it: the CLI tests need no torch
    old = torch.get_num_threads() if torch is not None else None
    if torch is not None:
        torch.set_num_threads(1)
    yield
    if torch is not None and old is not None:
        torch.set_num_threads(old)


@pytest.fixture(scope="session")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Any:
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from helpers.engine import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny-llama"))
