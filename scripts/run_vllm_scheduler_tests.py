"""Run vLLM's own scheduler unit tests stock and with pagedkv's scheduler plug-in in place.

The vLLM wheel ships no tests; its source distribution on PyPI does. This script downloads the
sdist of the vLLM release installed in ``--python``'s environment (from PyPI's simple index,
checked against the index's SHA-256), extracts its ``tests/`` folder under ``--work-dir``, and
runs a suite of its test files twice with that interpreter: once stock, once with this file
loaded as a pytest plugin (``-p run_vllm_scheduler_tests``) that substitutes
``pagedkv.integrations.vllm.PagedKVScheduler`` for vLLM's ``Scheduler`` (and
``PagedKVAsyncScheduler`` for ``AsyncScheduler``) wherever the tests build one. It prints pass /
fail / skip / error counts per mode, and the tests whose outcome differs between the two, and
writes the JUnit reports under
``--work-dir``. vLLM's code is downloaded to ``--work-dir`` only; nothing of it is kept here.

Suites (``--suite``): ``core``, vLLM's scheduler tests (``tests/v1/core``); ``connectors``, the
scheduler side of its KV connector unit tests (``tests/v1/kv_connector/unit``: remote prefill and
decode lifecycles, load-failure recovery, invalid blocks, cache pollution, error propagation,
bidirectional transfers, connector override, ``MultiConnector``, connector lifecycle, NIXL's
scheduler-side tests, the offloading connector's scheduler tests). A test file or test the
installed release does not have is left out and listed. The vLLM release is the one installed in
``--python``'s venv (``target/vllm-venv``: 0.33, ``target/vllm-0.32-venv``: 0.32); each release's
sdist is downloaded once into ``--work-dir``.

Tests of features the plug-in refuses by design (:data:`EXPECTED_REFUSED`, each with its reason)
are marked expected failures in plug-in mode and listed apart from the differences.

Offline: the tests name Hugging Face models (``facebook/opt-125m`` mostly). Only the models'
configs are needed (the scheduler loads no weights); the script writes OPT-125m's ``config.json``
and, for the randomized priority "blast" workload, Qwen2.5-VL-3B-Instruct's ``config.json`` and
``preprocessor_config.json`` (the multimodal encoder budget reads the image processor), with
their published values, into a private ``HF_HOME`` and runs with ``HF_HUB_OFFLINE=1``. Tests
that need other models' configs fail in both modes (reported as such). pagedkv is imported from
the caller's ``PYTHONPATH`` when set (a worktree's ``python/`` before the venv's own install). vLLM's top-level
``tests/conftest.py`` needs packages the scheduler venv lacks (``tblib``, ...), so conftest files
are loaded only from ``tests/v1`` down (``--confcutdir``): the connector tests' own conftests (a
CPU block-size mock, the offloading tests' ``request_runner`` fixture) stay. The one fixture of
the top-level conftest the scheduler tests use, ``caplog_vllm``, is provided by the plugin.
Tests that need its other fixtures (``dist_init``, ...) are worker-side and not selected.
``test_nixl_connector.py`` imports ``ray`` at module level for one worker test; where ``ray`` is
not installed the plugin puts a stand-in module in its place whose every attribute raises
``ImportError``, so the module's scheduler tests can be collected.

Usage (see ``make test-vllm-upstream``)::

    python scripts/run_vllm_scheduler_tests.py --python target/vllm-venv/bin/python
    python scripts/run_vllm_scheduler_tests.py --suite connectors --python target/vllm-0.32-venv/bin/python
    python scripts/run_vllm_scheduler_tests.py --mode plugin -- -k spec   # extra pytest args

Not part of ``make test``: it downloads ~47 MB and runs for several minutes.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import re
import subprocess
import sys
import tarfile
import urllib.request
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

CORE_TESTS = (
    "tests/v1/core/test_scheduler.py",
    "tests/v1/core/test_async_scheduler.py",
    "tests/v1/core/test_deferred_block_free.py",
    "tests/v1/core/test_swa_inflight_window_free.py",
    "tests/v1/core/test_prefix_replay.py",
    "tests/v1/core/test_priority_preemption_bug.py",
    "tests/v1/core/test_priority_scheduler_random.py",
)
_UNIT = "tests/v1/kv_connector/unit"
#: The scheduler side of vLLM's KV connector unit tests: whole files, and from
#: ``test_nixl_connector.py`` (mostly worker tests) the tests that build a scheduler and need no
#: distributed environment.
CONNECTOR_TESTS = (
    f"{_UNIT}/test_remote_prefill_lifecycle.py",
    f"{_UNIT}/test_remote_decode_lifecycle.py",
    f"{_UNIT}/test_kv_load_failure_recovery.py",
    f"{_UNIT}/test_invalid_blocks_correctness.py",
    f"{_UNIT}/test_cache_pollution_prevention.py",
    f"{_UNIT}/test_error_propagation.py",
    f"{_UNIT}/test_bidirectional_kv_transfer.py",
    f"{_UNIT}/test_scheduler_kv_connector_override.py",
    f"{_UNIT}/test_multi_connector.py",
    f"{_UNIT}/test_kv_connector_lifecycle.py",
    f"{_UNIT}/test_nixl_connector.py::test_basic_interface",
    f"{_UNIT}/test_nixl_connector.py::test_prompt_less_than_block_size",
    f"{_UNIT}/test_nixl_connector.py::test_abort_immediately_remote_prefill_enqueues_empty_recv",
    f"{_UNIT}/test_nixl_connector.py::test_prefill_exports_cached_tokens_in_kv_transfer_params",
    f"{_UNIT}/test_nixl_connector.py::test_scheduler_kv_connector_stats_aggregation",
    f"{_UNIT}/offloading_connector/test_scheduler.py",
    f"{_UNIT}/test_offloading_connector.py",
)
SUITES = {"core": CORE_TESTS, "connectors": CONNECTOR_TESTS}
#: Tests of features the plug-in refuses by design (test id prefix -> reason); in plug-in mode
#: they are expected failures (``xfail``, not strict: they also fail stock where the venv lacks
#: what they need).
_MAMBA_CONNECTOR = (
    "align-mode Mamba speculative state blocks with a KV connector are refused by the plug-in "
    "(config_check; align-mode Mamba groups are served with and without a KV connector, "
    "mode-none ones too)"
)
_MAMBA_HIT_DIVERGENCE = (
    "drives vLLM's coordinator and pool directly (isinstance HybridKVCacheCoordinator, "
    "find_longest_cache_hit_per_group, block_pool.evict_blocks; pagedkv's are read-only views) "
    "on Mamba states vLLM caches at allocation with no step run (pagedkv publishes a state at "
    "its step's commit); the aux-output variant also needs the aux-output connector, refused "
    "(divergent hits themselves are served: tests/integrations/vllm/test_vllm_mamba_connectors.py)"
)
_CORE_SCHED = "tests/v1/core/test_scheduler.py"
EXPECTED_REFUSED = {
    f"{_UNIT}/test_remote_prefill_lifecycle.py::"
    "test_async_load_does_not_double_reserve_mamba_spec_blocks[align-16-18]": _MAMBA_CONNECTOR,
    **{
        f"{_CORE_SCHED}::{name}": _MAMBA_HIT_DIVERGENCE
        for name in (
            "test_hybrid_per_group_hit_divergence_with_connector",
            "test_hybrid_divergent_hit_fallback_is_capped_at_retained_auxiliary_outputs",
            "test_hybrid_fa_deeper_hit_respects_connector_lookup_policy",
        )
    },
}
_OFFLOAD_SCHED = f"{_UNIT}/offloading_connector/test_scheduler.py"
EXPECTED_REFUSED.update(
    {
        **{
            f"{_OFFLOAD_SCHED}::test_swa_alignment_skip[{mode}-{extra}]": (
                "SlidingWindowSpec.extra_retained_tokens (blocks kept below the window, not attended) "
                "is refused by the plug-in (config_check)"
            )
            for mode in ("True", "False")
            for extra in (1, 3)
        },
        f"{_OFFLOAD_SCHED}::test_streaming_session_stores_new_chunks": (
            "streaming-input sessions (resumable requests) are refused by the plug-in"
        ),
        f"{_OFFLOAD_SCHED}::TestSharedGroupMTPOffload::test_no_annotation_marks_no_groups": (
            "lookahead slots (MTP / EAGLE num_lookahead_tokens) with a KV connector are refused by the plug-in"
        ),
        **{
            f"{_OFFLOAD_SCHED}::{name}": (
                "the test forces a preemption by writing vLLM's free-block counter "
                "(block_pool.free_block_queue.num_free_blocks = 0); pagedkv's pool is read-only to vLLM"
            )
            for name in ("test_request_preemption", "test_async_preempt_readmit_before_transfer_output_is_deferred")
        },
    }
)
SIMPLE_INDEX = "https://pypi.org/simple/vllm/"
# OPT-125m's published architecture (the scheduler reads max_position_embeddings = 2048).
OPT_125M_CONFIG = {
    "architectures": ["OPTForCausalLM"],
    "model_type": "opt",
    "hidden_size": 768,
    "num_hidden_layers": 12,
    "num_attention_heads": 12,
    "ffn_dim": 3072,
    "max_position_embeddings": 2048,
    "vocab_size": 50272,
    "word_embed_proj_dim": 768,
    "do_layer_norm_before": True,
    "activation_function": "relu",
    "bos_token_id": 2,
    "eos_token_id": 2,
    "pad_token_id": 1,
    "torch_dtype": "float16",
    "enable_bias": True,
    "layer_norm_elementwise_affine": True,
}
# Qwen2.5-VL-3B-Instruct's published text / vision architecture and image processor values.
QWEN25_VL_3B_CONFIG = {
    "architectures": ["Qwen2_5_VLForConditionalGeneration"],
    "model_type": "qwen2_5_vl",
    "hidden_size": 2048,
    "intermediate_size": 11008,
    "num_hidden_layers": 36,
    "num_attention_heads": 16,
    "num_key_value_heads": 2,
    "hidden_act": "silu",
    "max_position_embeddings": 128000,
    "max_window_layers": 70,
    "rms_norm_eps": 1e-06,
    "rope_theta": 1000000.0,
    "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]},
    "sliding_window": 32768,
    "use_sliding_window": False,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
    "vocab_size": 151936,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
    "vision_start_token_id": 151652,
    "vision_end_token_id": 151653,
    "vision_token_id": 151654,
    "image_token_id": 151655,
    "video_token_id": 151656,
    "vision_config": {
        "depth": 32,
        "hidden_act": "silu",
        "hidden_size": 1280,
        "intermediate_size": 3420,
        "num_heads": 16,
        "in_chans": 3,
        "out_hidden_size": 2048,
        "patch_size": 14,
        "spatial_merge_size": 2,
        "spatial_patch_size": 14,
        "window_size": 112,
        "fullatt_block_indexes": [7, 15, 23, 31],
        "tokens_per_second": 2,
        "temporal_patch_size": 2,
    },
}
QWEN25_VL_PREPROCESSOR = {
    "image_processor_type": "Qwen2VLImageProcessor",
    "processor_class": "Qwen2_5_VLProcessor",
    "min_pixels": 3136,
    "max_pixels": 12845056,
    "patch_size": 14,
    "temporal_patch_size": 2,
    "merge_size": 2,
    "image_mean": [0.48145466, 0.4578275, 0.40821073],
    "image_std": [0.26862954, 0.26130258, 0.27577711],
}
_SNAPSHOT = "0" * 40


# ---- the pytest plugin (loaded in the test process with -p run_vllm_scheduler_tests) ----------


def _stand_in_ray() -> None:
    """Puts a stand-in ``ray`` module in ``sys.modules`` if ``ray`` is not installed: importing
    it works, any attribute (or submodule) raises ``ImportError``."""
    import importlib.machinery
    import importlib.util
    import types

    if importlib.util.find_spec("ray") is not None:
        return

    class _Missing(types.ModuleType):
        def __getattr__(self, name: str) -> Any:
            if name.startswith("__"):
                raise AttributeError(name)
            raise ImportError(f"ray is not installed (stand-in module, no ray.{name})")

    mod = _Missing("ray")
    mod.__spec__ = importlib.machinery.ModuleSpec("ray", None)
    sys.modules["ray"] = mod


def pytest_load_initial_conftests(early_config: Any, parser: Any, args: list[str]) -> None:
    """Substitutes before the initial conftests load: the offloading tests' conftest imports
    the unit tests' ``utils``, which binds ``Scheduler`` by name at import."""
    _substitute()


def pytest_configure(config: Any) -> None:
    """Substitutes the plug-in's schedulers before any test module imports vLLM's (again,
    in case the early hook did not run: it is idempotent)."""
    _substitute()


def _substitute() -> None:
    if os.environ.get("PAGEDKV_UPSTREAM_STAND_IN_RAY") == "1":
        _stand_in_ray()
    if os.environ.get("PAGEDKV_UPSTREAM_MODE") != "plugin":
        return
    import vllm.v1.core.sched.async_scheduler as async_mod
    import vllm.v1.core.sched.scheduler as sched_mod

    from pagedkv.integrations.vllm import PagedKVAsyncScheduler, PagedKVScheduler

    sched_mod.Scheduler = PagedKVScheduler  # type: ignore[misc, unused-ignore]
    async_mod.AsyncScheduler = PagedKVAsyncScheduler  # type: ignore[misc, unused-ignore]


def pytest_collection_modifyitems(config: Any, items: list[Any]) -> None:
    """In plug-in mode, marks the tests of :data:`EXPECTED_REFUSED` as expected failures."""
    if os.environ.get("PAGEDKV_UPSTREAM_MODE") != "plugin":
        return
    import pytest

    for item in items:
        for prefix, reason in EXPECTED_REFUSED.items():
            if item.nodeid == prefix or item.nodeid.startswith(prefix + "["):
                item.add_marker(pytest.mark.xfail(reason=f"refused by the plug-in: {reason}", strict=False))


def _caplog_vllm_fixture() -> Any:
    import pytest

    @pytest.fixture()
    def caplog_vllm(caplog: Any) -> Any:
        """vLLM's log records through pytest's caplog (vLLM's logger propagates to the root)."""
        logger = logging.getLogger("vllm")
        old = logger.propagate
        logger.propagate = True
        try:
            with caplog.at_level(logging.INFO):
                yield caplog
        finally:
            logger.propagate = old

    return caplog_vllm


if "pytest" in sys.modules:
    caplog_vllm = _caplog_vllm_fixture()


# ---- the runner ------------------------------------------------------------------------------


def _installed_version(python: str) -> str:
    out = subprocess.run(
        [python, "-c", "import importlib.metadata as m; print(m.version('vllm'))"],
        check=True,
        capture_output=True,
        text=True,
    )
    return out.stdout.strip()


def fetch_sdist(version: str, dest: Path) -> Path:
    """The sdist ``vllm-VERSION.tar.gz`` in ``dest``, downloaded from PyPI's simple index and
    checked against its SHA-256 unless already there. Raises ``RuntimeError`` if the index has
    no sdist of that version or the digest differs."""
    dest.mkdir(parents=True, exist_ok=True)
    name = f"vllm-{version}.tar.gz"
    path = dest / name
    if path.exists():
        return path
    with urllib.request.urlopen(SIMPLE_INDEX, timeout=60) as resp:
        index = resp.read().decode()
    match = re.search(r'href="([^"#]*/' + re.escape(name) + r')#sha256=([0-9a-f]{64})"', index)
    if match is None:
        raise RuntimeError(f"{SIMPLE_INDEX} lists no {name}")
    url, digest = match.groups()
    tmp = path.with_suffix(".part")
    with urllib.request.urlopen(url, timeout=600) as resp, tmp.open("wb") as f:
        h = hashlib.sha256()
        while chunk := resp.read(1 << 20):
            h.update(chunk)
            f.write(chunk)
    if h.hexdigest() != digest:
        tmp.unlink()
        raise RuntimeError(f"{name}: sha256 {h.hexdigest()} != index {digest}")
    tmp.rename(path)
    return path


def extract_tests(sdist: Path, dest: Path) -> Path:
    """The sdist's ``tests/`` folder extracted under ``dest`` (once); returns the folder
    holding ``tests``."""
    root = dest / sdist.name.removesuffix(".tar.gz")
    if not (root / "tests").is_dir():
        with tarfile.open(sdist) as tar:
            members = [m for m in tar.getmembers() if m.name.startswith(f"{root.name}/tests/")]
            tar.extractall(dest, members=members, filter="data")
    return root


def offline_hf_home(dest: Path) -> Path:
    """A Hugging Face cache holding only facebook/opt-125m's ``config.json`` and
    Qwen/Qwen2.5-VL-3B-Instruct's ``config.json`` and ``preprocessor_config.json``."""
    models = {
        "models--facebook--opt-125m": {"config.json": OPT_125M_CONFIG},
        "models--Qwen--Qwen2.5-VL-3B-Instruct": {
            "config.json": QWEN25_VL_3B_CONFIG,
            "preprocessor_config.json": QWEN25_VL_PREPROCESSOR,
        },
    }
    for name, files in models.items():
        repo = dest / "hub" / name
        snap = repo / "snapshots" / _SNAPSHOT
        snap.mkdir(parents=True, exist_ok=True)
        (repo / "refs").mkdir(exist_ok=True)
        (repo / "refs" / "main").write_text(_SNAPSHOT)
        for file, content in files.items():
            (snap / file).write_text(json.dumps(content))
    return dest


def present(root: Path, tests: list[str]) -> tuple[list[str], list[str]]:
    """``tests`` split into those the extracted release has and those it lacks (a file that is
    not there, or a ``file::test`` whose file defines no such test function)."""
    have: list[str] = []
    lack: list[str] = []
    for t in tests:
        path, _, name = t.partition("::")
        f = root / path
        ok = f.is_file() and (not name or re.search(rf"^\s*(async )?def {re.escape(name)}\(", f.read_text(), re.M))
        (have if ok else lack).append(t)
    return have, lack


def run_mode(
    python: str, root: Path, tests: list[str], mode: str, hf_home: Path, extra: list[str], tag: str = ""
) -> Path:
    """Runs pytest in ``root`` in ``mode`` (``stock`` / ``plugin``); returns its JUnit XML
    (``junit-{tag}-{mode}.xml`` next to ``root``)."""
    report = root.parent / f"junit-{tag + '-' if tag else ''}{mode}.xml"
    env = dict(os.environ)
    env.update(
        PAGEDKV_UPSTREAM_MODE=mode,
        PAGEDKV_UPSTREAM_STAND_IN_RAY="1",
        HF_HOME=str(hf_home),
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        VLLM_LOGGING_LEVEL="ERROR",
        VLLM_TARGET_DEVICE="cpu",
        # The caller's PYTHONPATH is kept (a checkout's sources ahead of an installed pagedkv).
        PYTHONPATH=os.pathsep.join(
            [str(Path(__file__).resolve().parent), str(root), *filter(None, [os.environ.get("PYTHONPATH")])]
        ),
    )
    cmd = [
        python,
        "-m",
        "pytest",
        "-q",
        # Conftests of tests/v1 and below only (not tests/conftest.py, see the module docstring).
        "--confcutdir",
        str(root / "tests" / "v1"),
        "-p",
        "run_vllm_scheduler_tests",
        "-p",
        "no:cacheprovider",
        "-W",
        "ignore",
        "--rootdir",
        str(root),
        f"--junitxml={report}",
        *tests,
        *extra,
    ]
    print(f"== {mode}: {' '.join(cmd)}", flush=True)
    subprocess.run(cmd, cwd=root, env=env, check=False)
    return report


def outcomes(report: Path) -> dict[str, tuple[str, str]]:
    """``test id -> (outcome, first line of the failure message)`` from a JUnit report."""
    out: dict[str, tuple[str, str]] = {}
    for case in ET.parse(report).getroot().iter("testcase"):
        tid = f"{case.get('classname')}::{case.get('name')}"
        status, msg = "passed", ""
        for child in case:
            if child.tag in ("failure", "error", "skipped"):
                status = {"failure": "failed", "error": "error", "skipped": "skipped"}[child.tag]
                msg = (child.get("message") or "").splitlines()[0][:200] if child.get("message") else ""
        out[tid] = (status, msg)
    return out


def _counts(res: dict[str, tuple[str, str]]) -> str:
    names = ("passed", "failed", "error", "skipped")
    return ", ".join(f"{sum(1 for s, _ in res.values() if s == n)} {n}" for n in names)


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point; returns 0 (the counts are the result, not an exit status)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--python", default="target/vllm-venv/bin/python", help="interpreter with vLLM + pytest")
    ap.add_argument("--work-dir", default="/tmp/pagedkv-vllm-upstream", help="where the sdist and reports go")
    ap.add_argument("--mode", choices=("both", "stock", "plugin"), default="both")
    ap.add_argument("--suite", choices=sorted(SUITES), default="core", help="which test files (default core)")
    ap.add_argument("--tests", nargs="*", default=None, help="test files inside the sdist (instead of --suite)")
    ap.add_argument("pytest_args", nargs="*", help="extra pytest arguments (after --)")
    args = ap.parse_args(argv)
    work = Path(args.work_dir)
    # Not resolved (a venv's python is a symlink to the base interpreter): made absolute only.
    python = str(Path(args.python).absolute())
    version = _installed_version(python)
    root = extract_tests(fetch_sdist(version, work), work)
    hf_home = offline_hf_home(work / "hf-home")
    tests, missing = present(root, list(args.tests if args.tests is not None else SUITES[args.suite]))
    tag = f"{version}-{'custom' if args.tests is not None else args.suite}"
    modes = ["stock", "plugin"] if args.mode == "both" else [args.mode]
    results = {m: outcomes(run_mode(python, root, tests, m, hf_home, args.pytest_args, tag)) for m in modes}
    print(f"\nvLLM {version}, {len(tests)} test files / tests: {', '.join(tests)}")
    if missing:
        print(f"  not in this release: {', '.join(missing)}")
    for mode, res in results.items():
        print(f"  {mode:6s}: {_counts(res)}")
    if len(results) == 2:
        stock, plugin = results["stock"], results["plugin"]
        refused = sorted(t for t in stock if t in plugin and stock[t][0] != plugin[t][0] and _refusal(t) is not None)
        differ = sorted(t for t in stock if t in plugin and stock[t][0] != plugin[t][0] and t not in refused)
        print(f"\n{len(differ)} tests whose outcome differs (stock -> plug-in):")
        for t in differ:
            print(f"  {t}: {stock[t][0]} -> {plugin[t][0]}  {plugin[t][1]}")
        if refused:
            print(f"\n{len(refused)} tests of features the plug-in refuses (expected failures, stock -> plug-in):")
            for t in refused:
                print(f"  {t}: {stock[t][0]} -> {plugin[t][0]}  ({_refusal(t)})")
    return 0


def _refusal(test_id: str) -> str | None:
    """The :data:`EXPECTED_REFUSED` reason of a JUnit test id (``dotted.module.path::name``;
    a test of a class: ``dotted.module.path.Class::name``)."""
    for prefix, reason in EXPECTED_REFUSED.items():
        path, *classes, name = prefix.split("::")
        owner = ".".join([path.removesuffix(".py").replace("/", "."), *classes])
        if test_id == f"{owner}::{name}" or test_id.startswith(f"{owner}::{name}["):
            return reason
    return None


if __name__ == "__main__":
    sys.exit(main())
