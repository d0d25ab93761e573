"""pytest configuration of the vLLM suite (runs in each supported vLLM's own venv).

vLLM 0.32's torch (2.13) warns ``torch.jit.script_method is deprecated`` from its own modules
while vLLM imports them; the suite's warnings-are-errors policy (pyproject.toml) would turn
vLLM's import into a collection error, so that one warning is ignored here.
"""

from __future__ import annotations

import pytest


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("filterwarnings", "ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")
