"""The README's "Inside vLLM" example runs as written (vLLM's scheduler on CPU, fake model) and
prints what its comments say. Runs only where vLLM is installed (``make test-vllm``)."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vLLM not installed (make test-vllm runs this suite)")

README = Path(__file__).resolve().parents[3] / "README.md"


def test_readme_vllm_example_runs() -> None:
    text = README.read_text(encoding="utf-8")
    block = re.search(
        r"<!-- README_VLLM_EXAMPLE_START -->\s*```python\n(.*?)```\s*<!-- README_VLLM_EXAMPLE_END -->",
        text,
        re.S,
    )
    assert block, "README.md lost its vLLM example markers"
    res = subprocess.run([sys.executable, "-c", block.group(1)], capture_output=True, text=True, check=False)
    assert res.returncode == 0, res.stderr[-3000:]
    lines = res.stdout.strip().splitlines()
    assert ast.literal_eval(lines[-2]) == {"a": 0, "b": 64}
    tokens, reason = lines[-1].rsplit(" ", 1)
    assert len(ast.literal_eval(tokens)) == 4 and reason == "length"


def test_readme_names_the_scheduler_class_that_exists() -> None:
    text = README.read_text(encoding="utf-8")
    assert "--scheduler-cls pagedkv.integrations.vllm.PagedKVScheduler" in text
    from vllm.config import SchedulerConfig

    cfg = SchedulerConfig.default_factory(scheduler_cls="pagedkv.integrations.vllm.PagedKVScheduler")
    from pagedkv.integrations.vllm import PagedKVScheduler

    assert cfg.get_scheduler_cls() is PagedKVScheduler
