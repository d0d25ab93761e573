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
    streaming = m.EXPECTED_REFUSED[f"{m._OFFLOAD_SCHED}::test_streaming_session_stores_new_chunks"]
    mtp = m.EXPECTED_REFUSED[f"{m._OFFLOAD_SCHED}::TestSharedGroupMTPOffload::test_no_annotation_marks_no_groups"]
    retained = m.EXPECTED_REFUSED[f"{m._OFFLOAD_SCHED}::test_swa_alignment_skip[True-1]"]
    assert len({streaming, mtp, retained}) == 3
    # A module-level test, plain and parametrized; an entry naming one parametrization.
    assert m._refusal(f"{sched}::test_streaming_session_stores_new_chunks") == streaming
    assert m._refusal(f"{sched}::test_streaming_session_stores_new_chunks[True]") == streaming
    assert m._refusal(f"{sched}::test_swa_alignment_skip[True-1]") == retained
    # A test of a class: JUnit's classname holds the class after the module.
    assert m._refusal(f"{sched}.TestSharedGroupMTPOffload::test_no_annotation_marks_no_groups") == mtp
    # Not refused: a test now served (groups of different block sizes), another
    # parametrization, a name that only starts like a refused one, the class as module.
    assert m._refusal(f"{sched}.TestEagle::test_chunked_prefill_uses_final_swa_store_horizon[aborted-sync]") is None
    assert m._refusal(f"{sched}::test_swa_alignment_skip[True-2]") is None
    assert m._refusal(f"{sched}::test_request_preemption_x") is None
    assert m._refusal(f"{sched}::test_streaming_session_stores_new_chunks_more") is None
    assert m._refusal(f"{sched}::test_no_annotation_marks_no_groups") is None
