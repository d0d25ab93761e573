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

from types import TracebackType

from pagedkv.errors import MissingDependencyError

__all__ = ["EXTRA_PACKAGES", "missing_dependency", "optional_imports"]

_ENGINE = frozenset(
    {"torch", "triton", "transformers", "gguf", "accelerate", "tokenizers", "safetensors", "tqdm", "rich"}
)

#: extra of ``pyproject.toml`` -> the top-level modules of the packages it installs that pagedkv
#: imports (tests/test_integrations_optional.py checks these against ``pyproject.toml``).
EXTRA_PACKAGES: dict[str, frozenset[str]] = {
    "torch": frozenset({"torch", "triton"}),
    "engine": _ENGINE,
    "routing": frozenset({"msgspec"}),
    # pagedkv.cluster runs LLMEngine replicas: its extra brings the engine's packages too.
    "ray": _ENGINE | {"ray", "msgspec"},
    "vllm": frozenset({"vllm"}),
    "transformers": frozenset({"transformers", "torch"}),
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


class _OptionalImports:
    """The context manager of :func:`optional_imports` (a class, not a generator: the tensor
    builders enter it on every call that returns torch tensors, so it must cost ~nothing)."""

    __slots__ = ("feature", "extra", "packages")

    def __init__(self, feature: str, extra: str) -> None:
        self.feature = feature
        self.extra = extra
        self.packages = EXTRA_PACKAGES[extra]

    def __enter__(self) -> None:
        return None

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        # A MissingDependencyError of a nested part (the engine importing the kernels) is
        # explained again here: the part the caller asked for names the extra to install.
        if isinstance(exc, ModuleNotFoundError):
            missing = (exc.name or "").partition(".")[0]
            if missing in self.packages:
                raise missing_dependency(self.feature, missing, self.extra) from exc


def optional_imports(feature: str, extra: str) -> _OptionalImports:
    """A context manager for the imports of an optional part: if one fails because a package of
    ``extra`` is missing, it raises :class:`~pagedkv.errors.MissingDependencyError` instead.

    Usage: ``with optional_imports("pagedkv.kernels", "torch"): import torch``.

    Args:
        feature: the pagedkv part doing the imports, for the message (``"pagedkv.kernels"``).
        extra: a key of :data:`EXTRA_PACKAGES` (an extra of ``pyproject.toml``).

    Raises:
        MissingDependencyError: (on exit) a module of ``extra``'s packages is not installed (a
            ``ModuleNotFoundError`` and an ``ImportError``, chained from the original).
        KeyError: ``extra`` is not a known extra (a bug in the caller).
    """
    return _OptionalImports(feature, extra)
