"""Imports of optional dependencies that fail with the extra to install, not a bare
``ModuleNotFoundError``.

``import pagedkv`` needs numpy only. Each optional part imports its packages inside
:func:`optional_imports`, which turns "No module named 'torch'" into a
:class:`pagedkv.errors.MissingDependencyError` naming the part, the package and the
``pip install "pagedkv[<extra>]"`` command. Only a package the extra itself installs is
reported that way: any other missing module (a broken install, a bug, a package of another
extra) propagates unchanged.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from pagedkv.errors import MissingDependencyError

__all__ = ["EXTRA_PACKAGES", "missing_dependency", "optional_imports"]

#: extra of ``pyproject.toml`` -> the top-level modules of the packages it installs that pagedkv
#: imports (tests/test_optional_deps.py checks these against ``pyproject.toml``).
EXTRA_PACKAGES: dict[str, frozenset[str]] = {
    "torch": frozenset({"torch", "triton"}),
    "engine": frozenset(
        {"torch", "triton", "transformers", "gguf", "accelerate", "tokenizers", "safetensors", "tqdm", "rich"}
    ),
    "routing": frozenset({"msgspec"}),
    "ray": frozenset({"ray", "msgspec"}),
    "vllm": frozenset({"vllm"}),
}


def missing_dependency(feature: str, package: str, extra: str) -> MissingDependencyError:
    """The error for ``feature`` (a pagedkv part, for the message) needing ``package`` (a
    top-level module) that the ``extra`` of ``pyproject.toml`` installs; for checks that find a
    package missing without importing it (``find_spec``)."""
    return MissingDependencyError(
        f'{feature} needs {package}, which is not installed: pip install "pagedkv[{extra}]"',
        name=package,
        feature=feature,
        extra=extra,
    )


@contextmanager
def optional_imports(feature: str, extra: str) -> Iterator[None]:
    """Run the imports of the block; if one fails because a package of ``extra`` is missing,
    raise :class:`~pagedkv.errors.MissingDependencyError` instead.

    Args:
        feature: the pagedkv part doing the imports, for the message (``"pagedkv.kernels"``).
        extra: a key of :data:`EXTRA_PACKAGES` (an extra of ``pyproject.toml``).

    Raises:
        MissingDependencyError: a module of ``extra``'s packages is not installed (a
            ``ModuleNotFoundError`` and an ``ImportError``, chained from the original).
        KeyError: ``extra`` is not a known extra (a bug in the caller).
    """
    packages = EXTRA_PACKAGES[extra]
    try:
        yield
    except ModuleNotFoundError as e:
        # A MissingDependencyError of a nested part (the engine importing the kernels) is
        # explained again here: the part the caller asked for names the extra to install.
        missing = (e.name or "").partition(".")[0]
        if missing not in packages:
            raise
        raise missing_dependency(feature, missing, extra) from e
