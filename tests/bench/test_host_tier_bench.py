"""benchmarks/host_tier.py's output files and eviction sweep, on a tiny chat workload."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import host_tier  # noqa: E402


@pytest.fixture
def tiny(monkeypatch: pytest.MonkeyPatch) -> None:
    """A chat workload of 6 conversations and one host size (the code paths, not the figures)."""
    chat = host_tier.chat_workload
    monkeypatch.setattr(host_tier, "chat_workload", lambda: chat(6, open_at_once=3, system_prompts=2))
    monkeypatch.setattr(host_tier, "QUICK_SWEEPS", {"chat": (1 << 12, [0, 1 << 11])})
    monkeypatch.setattr(host_tier, "SWEEPS", {"chat": (1 << 12, [0, 1 << 11])})


ARGS = ["--no-ops", "--no-plot", "--workloads", "chat", "--min-seen", "1"]


def test_a_quick_run_never_replaces_the_full_results(tiny: None, tmp_path: Path) -> None:
    full = tmp_path / "host_tier.json"
    full.write_text('{"full": true}')
    host_tier.main(["--quick", *ARGS, "--results-dir", str(tmp_path)])
    assert json.loads(full.read_text()) == {"full": True}
    quick = json.loads((tmp_path / "host_tier_quick.json").read_text())
    assert quick["settings"]["quick"] is True
    # --out names the file, quick or not; a full run writes host_tier.json.
    host_tier.main(["--quick", *ARGS, "--out", str(tmp_path / "mine.json")])
    assert json.loads((tmp_path / "mine.json").read_text())["settings"]["quick"] is True
    host_tier.main([*ARGS, "--results-dir", str(tmp_path)])
    assert json.loads(full.read_text())["settings"]["quick"] is False


def test_the_sweep_runs_both_eviction_policies(tiny: None, tmp_path: Path) -> None:
    payload = host_tier.main(["--quick", *ARGS, "--results-dir", str(tmp_path)])
    runs = payload["sweeps"]["chat"]["runs"]
    assert [(r["host_tokens"], r["eviction"]) for r in runs] == [(0, None), (2048, "lru"), (2048, "arc")]
    with pytest.raises(SystemExit):
        host_tier.main([*ARGS, "--eviction", "fifo"])
