"""Shared setup for the kernel tests.

TRITON_INTERPRET=1 must be set before triton is first imported so the Triton kernels run on
CPU tensors. The `slow` marker tags large cases; they run only when PAGEDKV_SLOW=1 (or when
selected with ``-m slow``).
"""

import os
import sys
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
# The kernels package, imported now from the repository root put first on sys.path: the
# benchmark tests import benchmarks/host_tier.py, which puts benchmarks/ (holding a kernels.py)
# in front of sys.path, in whichever order the folders are collected.
if str(ROOT) in sys.path:
    sys.path.remove(str(ROOT))
sys.path.insert(0, str(ROOT))
import kernels  # noqa: E402, F401


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: large kernel cases, run with PAGEDKV_SLOW=1 or -m slow")


def pytest_collection_modifyitems(config, items):
    if os.environ.get("PAGEDKV_SLOW") == "1" or "slow" in (config.getoption("-m") or ""):
        return
    skip = pytest.mark.skip(reason="slow kernel case: set PAGEDKV_SLOW=1 to run")
    here = Path(__file__).resolve().parent
    for item in items:
        # This hook sees every collected item; only kernel cases are skipped here (the engine's
        # slow SmolLM2 tests run in CI).
        if "slow" in item.keywords and here in Path(item.path).resolve().parents:
            item.add_marker(skip)
