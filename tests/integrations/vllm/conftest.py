"""pytest configuration of the vLLM suite (runs in each supported vLLM's own venv).

vLLM 0.32's torch (2.13) warns ``torch.jit.script_method is deprecated`` from its own modules
while vLLM imports them; the suite's warnings-are-errors policy (pyproject.toml) would turn
vLLM's import into a collection error, so that one warning is ignored here.

vLLM's platform is its CPU one (``VLLM_TARGET_DEVICE=cpu``, set before any test module imports
vLLM), where these tests run: the installed CUDA build finds no GPU and would otherwise pick
its unspecified platform, which turns off vLLM's hybrid KV cache manager, so the engine core
would fold a sliding-window model's layers into one full-attention group.
"""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("filterwarnings", "ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")
