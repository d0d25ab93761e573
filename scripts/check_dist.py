#!/usr/bin/env python3
"""Build the wheel and the sdist with maturin, check what they contain, install the sdist once.

Checks:
- the wheel holds the extension ``pagedkv/_core*.so``, ``_core.pyi``, ``py.typed``, every
  Python file of ``python/pagedkv`` and every ``kernels/**/*.py`` as ``pagedkv/kernels/...``
  (the kernels reach the package through a symlink, which maturin only follows with an explicit
  ``include``), and the ``pagedkv-engine`` console script;
- the sdist holds the Rust sources of both crates, the lock file, the same Python files and the
  kernels as real files under ``python/pagedkv/kernels``;
- ``pip install <sdist>`` into a throwaway plain virtualenv builds, and ``import pagedkv,
  pagedkv.kernels`` works from it. The throwaway venv sees the packages of the environment
  running this script (the one ``make setup`` installed into) through a ``.pth`` file, so numpy
  and torch are not downloaded again, and nothing outside that environment (the base
  interpreter's own site-packages) is ever visible to it.

Run from anywhere: ``python scripts/check_dist.py`` (``make check-dist``). Exits non-zero with
a list of what is missing.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import tempfile
import venv
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def run(cmd: list[str], **kwargs: object) -> None:
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, **kwargs)  # type: ignore[call-overload]


def maturin() -> list[str]:
    """The maturin command: `python -m maturin` when it works (it needs the `maturin` script
    beside this interpreter), else the `maturin` on PATH."""
    probe = subprocess.run([sys.executable, "-m", "maturin", "--version"], capture_output=True, check=False)
    if probe.returncode == 0:
        return [sys.executable, "-m", "maturin"]
    found = shutil.which("maturin")
    if found is None:
        raise SystemExit("maturin not found: pip install 'maturin>=1.12.1,<2'")
    return [found]


def expected_python_files() -> set[str]:
    """Package-relative paths (``pagedkv/...``) of every .py / .pyi / py.typed file to ship."""
    pkg = ROOT / "python" / "pagedkv"
    out: set[str] = set()
    for dirpath, dirnames, filenames in os.walk(pkg, followlinks=True):
        dirnames[:] = [d for d in dirnames if d != "__pycache__"]
        for name in filenames:
            if name.endswith((".py", ".pyi")) or name == "py.typed":
                rel = Path(dirpath, name).relative_to(pkg.parent)
                out.add(rel.as_posix())
    return out


def check_wheel(wheel: Path, want: set[str]) -> list[str]:
    names = set(zipfile.ZipFile(wheel).namelist())
    problems = [f"wheel lacks {p}" for p in sorted(want - names)]
    if not any(n.startswith("pagedkv/_core") and n.endswith((".so", ".pyd")) for n in names):
        problems.append("wheel lacks the extension pagedkv/_core*.so")
    kernels = [n for n in names if n.startswith("pagedkv/kernels/") and n.endswith(".py")]
    if "pagedkv/kernels/__init__.py" not in names:
        problems.append("wheel lacks pagedkv/kernels/__init__.py")
    entry = [n for n in names if n.endswith(".dist-info/entry_points.txt")]
    if not entry or "pagedkv-engine" not in zipfile.ZipFile(wheel).read(entry[0]).decode():
        problems.append("wheel lacks the pagedkv-engine console script")
    print(f"wheel {wheel.name}: {len(names)} files, {len(kernels)} kernel modules")
    return problems


def check_sdist(sdist: Path, want: set[str]) -> list[str]:
    with tarfile.open(sdist) as tar:
        members = {m.name.split("/", 1)[1]: m for m in tar.getmembers() if "/" in m.name}
    problems = [f"sdist lacks python/{p}" for p in sorted(want) if f"python/{p}" not in members]
    for required in (
        "pyproject.toml",
        "Cargo.toml",
        "Cargo.lock",
        "README.md",
        "rust/core/Cargo.toml",
        "rust/python/Cargo.toml",
        "rust/core/src/lib.rs",
        "rust/python/src/lib.rs",
    ):
        if required not in members:
            problems.append(f"sdist lacks {required}")
    for name, member in members.items():
        if name.startswith("python/pagedkv/kernels") and member.issym():
            problems.append(f"sdist keeps {name} as a symlink (must be real files)")
    print(f"sdist {sdist.name}: {len(members)} files")
    return problems


def inherit_active_environment(py: Path) -> None:
    """Make the venv of interpreter ``py`` see this environment's site-packages (after its own).

    A ``.pth`` line appends a directory to ``sys.path`` without running that directory's own
    ``.pth`` files, so this environment's editable ``pagedkv`` stays invisible: the throwaway
    venv imports only the ``pagedkv`` installed into it, and everything else from here.
    """
    own = subprocess.run(
        [str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    paths = sysconfig.get_paths()
    inherited = sorted({paths["purelib"], paths["platlib"]})
    Path(own, "_pagedkv_check_dist_parent.pth").write_text("".join(f"{p}\n" for p in inherited))


def install_sdist(sdist: Path, tmp: Path) -> None:
    env_dir = tmp / "venv"
    venv.EnvBuilder(system_site_packages=False, with_pip=True).create(env_dir)
    py = env_dir / "bin" / "python"
    inherit_active_environment(py)
    env = dict(os.environ)
    # Reuse the repository's compiled dependencies: only the two path crates are rebuilt.
    env.setdefault("CARGO_TARGET_DIR", str(ROOT / "target"))
    run(
        [
            str(py),
            "-m",
            "pip",
            "install",
            "--disable-pip-version-check",
            "--progress-bar",
            "off",
            "--no-build-isolation",
            "--no-deps",
            str(sdist),
        ],
        env=env,
    )
    probe = (
        "import pathlib, sys, pagedkv, pagedkv.kernels, pagedkv.tensors\n"
        "home = pathlib.Path(sys.prefix).resolve()\n"
        "for mod in (pagedkv, pagedkv.kernels, pagedkv._core):\n"
        "    path = pathlib.Path(mod.__file__).resolve()\n"
        "    assert home in path.parents, f'{mod.__name__} imported from {path}, not the venv'\n"
        "m = pagedkv.KVCacheManager(pagedkv.CacheConfig(8, 4))\n"
        "m.add_sequence(1, [1, 2, 3, 4, 5])\n"
        "assert m.allocate_slots(1, 8).new_block_ids.tolist() == [1, 2]\n"
        "print('sdist install OK:', pagedkv.__version__, pagedkv.__file__)\n"
    )
    run([str(py), "-c", probe], cwd=tmp)


def main() -> int:
    want = expected_python_files()
    problems: list[str] = []
    with tempfile.TemporaryDirectory(prefix="pagedkv-dist-") as tmp_s:
        tmp = Path(tmp_s)
        tool = maturin()
        run([*tool, "build", "--release", "--out", str(tmp / "wheel")], cwd=ROOT)
        run([*tool, "sdist", "--out", str(tmp / "sdist")], cwd=ROOT)
        wheels = sorted((tmp / "wheel").glob("*.whl"))
        sdists = sorted((tmp / "sdist").glob("*.tar.gz"))
        if len(wheels) != 1 or len(sdists) != 1:
            print(f"expected one wheel and one sdist, got {wheels} {sdists}", file=sys.stderr)
            return 1
        problems += check_wheel(wheels[0], want)
        problems += check_sdist(sdists[0], want)
        if not problems:
            install_sdist(sdists[0], tmp)
    if problems:
        print("dist check FAILED:", *problems, sep="\n  ", file=sys.stderr)
        return 1
    print(f"dist check OK: {len(want)} Python files in wheel and sdist, sdist installs and imports")
    return 0


if __name__ == "__main__":
    sys.exit(main())
