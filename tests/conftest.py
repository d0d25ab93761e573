"""Shared pytest configuration: hypothesis profiles, the `gpu` marker, pytest-xdist groups.

Profiles (chosen by the HYPOTHESIS_PROFILE environment variable, default "ci"):
- "ci": at least 200 examples per property, state machines of up to 50 steps, derandomized so a
  CI run is reproducible, no per-example deadline (CI machines are shared and slow).
- "long": for one-off soak runs (thousands of examples, random seeds).
HYPOTHESIS_MAX_EXAMPLES=N caps max_examples of the chosen profile (soak runs of a set length).

`make test` runs pytest in two processes (pytest-xdist, `--dist loadgroup`): a test that uses a
module- or class-scoped fixture joins its module's group, so that value is computed once. The
"ci" profile is derandomized, which turns hypothesis' example database off, so the workers share
no file.
"""

from __future__ import annotations

import os

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


#: Fixture scopes whose value one module's tests share: under pytest-xdist such tests stay on one
#: worker, or each worker would compute the value again (reference outputs of a model, the AOT
#: kernel compile).
_SHARED_SCOPES = frozenset({"class", "module", "package"})


def _uses_a_shared_fixture(item: pytest.Item) -> bool:
    info = getattr(item, "_fixtureinfo", None)
    if info is None:
        return False
    for name in info.names_closure:
        defs = info.name2fixturedefs.get(name)
        if defs and defs[-1].scope in _SHARED_SCOPES:
            return True
    return False


# tryfirst: the markers must be in place before pytest-xdist reads them (`--dist loadgroup`).
@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip tests marked `gpu` when no CUDA device is present (the reason says so), and put each
    test that uses a module- or class-scoped fixture in its module's `xdist_group` (unless it
    names a group itself), so that `--dist loadgroup` runs those tests on one worker."""
    if any(item.get_closest_marker("gpu") for item in items) and not _cuda_available():
        skip = pytest.mark.skip(reason="needs a CUDA device; none present")
        for item in items:
            if item.get_closest_marker("gpu"):
                item.add_marker(skip)
    for item in items:
        if item.get_closest_marker("xdist_group") is None and _uses_a_shared_fixture(item):
            item.add_marker(pytest.mark.xdist_group(item.nodeid.split("::", 1)[0]))
