"""scripts/run_vllm_scheduler_tests.py: a JUnit test id is matched to its by-design refusal
(:data:`EXPECTED_REFUSED`), tests of a class and parametrized tests included."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "run_vllm_scheduler_tests.py"


def _load() -> Any:
    spec = importlib.util.spec_from_file_location("run_vllm_scheduler_tests", SCRIPT)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_refusals_are_found_for_module_class_and_parametrized_tests() -> None:
    m = _load()
    sched = "tests.v1.kv_connector.unit.offloading_connector.test_scheduler"
    block_sizes = m.EXPECTED_REFUSED[f"{m._OFFLOAD_SCHED}::test_two_groups_different_block_sizes"]
    mtp = m.EXPECTED_REFUSED[f"{m._OFFLOAD_SCHED}::TestSharedGroupMTPOffload::test_no_annotation_marks_no_groups"]
    assert block_sizes != mtp
    # A module-level test, plain and parametrized.
    assert m._refusal(f"{sched}::test_two_groups_different_block_sizes[True]") == block_sizes
    # A test of a class: JUnit's classname holds the class after the module.
    assert m._refusal(f"{sched}.TestSharedGroupMTPOffload::test_no_annotation_marks_no_groups") == mtp
    assert m._refusal(f"{sched}.TestEagle::test_chunked_prefill_uses_final_swa_store_horizon[aborted-sync]") == (
        block_sizes
    )
    # Not refused: another test, a name that only starts like a refused one, the class as module.
    assert m._refusal(f"{sched}::test_request_preemption_x") is None
    assert m._refusal(f"{sched}::test_two_groups_different_block_sizes_more") is None
    assert m._refusal(f"{sched}::test_no_annotation_marks_no_groups") is None
