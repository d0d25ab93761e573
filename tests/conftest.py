"""Shared pytest configuration: hypothesis profiles, the `gpu` marker, one Ray cluster at a time.

Profiles (chosen by the HYPOTHESIS_PROFILE environment variable, default "ci"):
- "ci": at least 200 examples per property, state machines of up to 50 steps, derandomized so a
  CI run is reproducible, no per-example deadline (CI machines are shared and slow).
- "long": for one-off soak runs (thousands of examples, random seeds).
HYPOTHESIS_MAX_EXAMPLES=N caps max_examples of the chosen profile (soak runs of a set length).

`make test` runs pytest in two processes (pytest-xdist, `--dist loadfile`: one file's tests on one
worker, so a module-scoped value such as a model's reference outputs is computed once). The "ci"
profile is derandomized, which turns hypothesis' example database off, so the workers share no
file; `one_ray_cluster` keeps the workers from starting two Ray clusters at once.
"""

from __future__ import annotations

import fcntl
import os
from collections.abc import Iterator

import pytest
from hypothesis import HealthCheck, settings

settings.register_profile(
    "ci",
    max_examples=200,
    stateful_step_count=50,
    deadline=None,
    derandomize=True,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile(
    "long",
    max_examples=20_000,
    stateful_step_count=100,
    deadline=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
# Optional cap for one-off soak runs of a chosen length (e.g. the "long" profile for ~10 min).
if os.environ.get("HYPOTHESIS_MAX_EXAMPLES"):
    settings.register_profile(
        "capped",
        settings(settings.default, max_examples=int(os.environ["HYPOTHESIS_MAX_EXAMPLES"])),
    )
    settings.load_profile("capped")


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip tests marked `gpu` when no CUDA device is present (the reason says so)."""
    if any(item.get_closest_marker("gpu") for item in items) and not _cuda_available():
        skip = pytest.mark.skip(reason="needs a CUDA device; none present")
        for item in items:
            if item.get_closest_marker("gpu"):
                item.add_marker(skip)


@pytest.fixture(scope="module")
def one_ray_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Hold a lock that the pytest-xdist workers of this run share while a module starts and uses
    a Ray cluster, so that a second worker's cluster waits instead of competing for the same two
    cores (Ray's start-up has timeouts). Outside pytest-xdist it holds nothing."""
    if os.environ.get("PYTEST_XDIST_WORKER") is None:
        yield
        return
    # Each worker's base temporary folder is popen-gwN inside the run's own one.
    lock_path = tmp_path_factory.getbasetemp().parent / "one-ray-cluster.lock"
    with open(lock_path, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
