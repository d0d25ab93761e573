"""``import pagedkv`` never needs a serving stack; ``pagedkv.integrations.vllm`` needs vLLM."""

from __future__ import annotations

import subprocess
import sys


def test_import_pagedkv_does_not_import_vllm() -> None:
    code = (
        "import sys, pagedkv, pagedkv.integrations\n"
        "assert 'vllm' not in sys.modules, 'import pagedkv pulled in vllm'\n"
        "assert 'pagedkv.integrations.vllm' not in sys.modules\n"
        "print('ok')\n"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "ok"


def test_vllm_integration_without_vllm_fails_on_import_naming_vllm() -> None:
    code = (
        "import importlib.util, sys\n"
        "if importlib.util.find_spec('vllm') is not None:\n"
        "    print('vllm installed'); sys.exit(0)\n"
        "try:\n"
        "    import pagedkv.integrations.vllm\n"
        "except ModuleNotFoundError as e:\n"
        "    print(e.name)\n"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() in ("vllm", "vllm installed")
