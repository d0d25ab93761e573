"""``import pagedkv`` needs numpy only; every optional part that needs a missing package fails
with :class:`pagedkv.MissingDependencyError` naming the package and the extra that installs it.

A missing package is simulated in a subprocess by ``sys.modules[name] = None`` (what Python does
for a module it must not import: ``import name`` raises ``ModuleNotFoundError`` and
``importlib.util.find_spec(name)`` returns ``None``), so the tests run whether or not the
package is installed here.
"""

from __future__ import annotations

import json
import pickle
import re
import subprocess
import sys
from pathlib import Path

import pytest

import pagedkv
from pagedkv._optional import EXTRA_PACKAGES, optional_imports

REPO = Path(__file__).resolve().parents[1]

# Every third-party package an optional part imports (the union of the extras' modules).
OPTIONAL = sorted(set().union(*EXTRA_PACKAGES.values()))


def _run(blocked: list[str], code: str) -> subprocess.CompletedProcess[str]:
    prelude = "import sys\n" + "".join(f"sys.modules[{name!r}] = None\n" for name in blocked)
    return subprocess.run(
        [sys.executable, "-c", prelude + code], capture_output=True, text=True, check=False, timeout=120
    )


def test_import_pagedkv_needs_no_optional_package() -> None:
    code = (
        "import pagedkv, pagedkv.integrations, pagedkv.routing, pagedkv.cluster, pagedkv.testing\n"
        "import pagedkv.integrations.transformers\n"
        "import pagedkv.engine, pagedkv.engine.errors, pagedkv.engine.goodput, pagedkv.engine.inputs\n"
        "import pagedkv.engine.chat, pagedkv.engine.cli\n"
        "from pagedkv import tensors\n"
        "m = pagedkv.KVCacheManager(pagedkv.CacheConfig(num_blocks=8, block_size=4))\n"
        "m.add_sequence(1, [1, 2, 3, 4, 5])\n"
        "m.allocate_slots(1, 5)\n"
        f"blocked = {OPTIONAL!r}\n"
        "loaded = sorted(n for n, mod in sys.modules.items() if mod is not None and n.split('.')[0] in blocked)\n"
        "print(json.dumps([m.block_table(1).tolist(), loaded]))\n"
    )
    res = _run(OPTIONAL, "import json\n" + code)
    assert res.returncode == 0, res.stderr
    table, loaded = json.loads(res.stdout)
    assert len(table) == 2 and loaded == []


# (blocked packages, code that uses the part, missing package, part named, extra)
PARTS = [
    (["torch"], "import pagedkv.kernels", "torch", "pagedkv.kernels", "torch"),
    (["torch"], "import pagedkv.kernels.reference", "torch", "pagedkv.kernels", "torch"),
    (["triton"], "import pagedkv.kernels.attention", "triton", "pagedkv.kernels.attention", "torch"),
    (
        ["triton"],
        "import torch, pagedkv.kernels as k\n"
        "k.copy_blocks(torch.zeros(1, 2, 4, 2, 1, 8), torch.tensor([[1, 2]]), backend='triton')",
        "triton",
        "pagedkv.kernels.copy_blocks(backend='triton')",
        "torch",
    ),
    (["torch"], "from pagedkv.engine import LLMEngine", "torch", "pagedkv.engine", "engine"),
    (["torch"], "from pagedkv.engine.sampling import SamplingParams", "torch", "pagedkv.engine", "engine"),
    (["transformers"], "from pagedkv.engine import LLMEngine\nLLMEngine()", "transformers", "pagedkv.engine", "engine"),
    (["tqdm"], "import pagedkv.engine.engine as e\ne.LLMEngine.run(None)", "tqdm", "pagedkv.engine", "engine"),
    (["vllm"], "import pagedkv.integrations.vllm", "vllm", "pagedkv.integrations.vllm", "vllm"),
    (["vllm"], "import pagedkv.integrations.vllm.scheduler", "vllm", "pagedkv.integrations.vllm", "vllm"),
    (["vllm"], "import pagedkv.testing.vllm_scheduler", "vllm", "pagedkv.testing.vllm_scheduler", "vllm"),
    (
        ["transformers"],
        "from pagedkv.integrations.transformers import install\ninstall()",
        "transformers",
        "pagedkv.integrations.transformers",
        "transformers",
    ),
    (
        ["torch"],
        "import pagedkv.integrations.transformers.cache",
        "torch",
        "pagedkv.integrations.transformers",
        "transformers",
    ),
    (["ray"], "from pagedkv.cluster import ReplicaCluster\nReplicaCluster(1)", "ray", "pagedkv.cluster", "ray"),
    (
        ["msgspec"],
        "from pagedkv.routing import wire\nwire.encode_event_batch([])",
        "msgspec",
        "pagedkv.routing.wire",
        "routing",
    ),
    (["torch"], "from pagedkv.tensors import _movers\n_movers('cpu')", "torch", "pagedkv.tensors", "torch"),
]

REPORT = """
try:
{body}
except ImportError as e:
    import json, pagedkv
    print(json.dumps({{"type": type(e).__name__, "message": str(e), "name": e.name,
                      "extra": getattr(e, "extra", None), "feature": getattr(e, "feature", None),
                      "module_not_found": isinstance(e, ModuleNotFoundError),
                      "pagedkv_error": isinstance(e, pagedkv.PagedKVError)}}))
else:
    print("null")
"""


@pytest.mark.parametrize(
    ("blocked", "code", "package", "feature", "extra"), PARTS, ids=[f"{p[3]}-{p[2]}" for p in PARTS]
)
def test_missing_package_names_itself_and_the_extra(
    blocked: list[str], code: str, package: str, feature: str, extra: str
) -> None:
    res = _run(blocked, REPORT.format(body="\n".join("    " + line for line in code.splitlines())))
    assert res.returncode == 0, res.stderr
    err = json.loads(res.stdout)
    assert err is not None, f"{code!r} worked without {blocked}"
    assert err["type"] == "MissingDependencyError" and err["module_not_found"] and err["pagedkv_error"]
    assert (err["name"], err["extra"]) == (package, extra)
    assert err["feature"].startswith(feature)
    assert err["message"] == (
        f'{err["feature"]} needs {package}, which is not installed: pip install "pagedkv[{extra}]"'
    )


def test_every_engine_module_without_torch_names_the_engine_extra() -> None:
    """Whichever engine module is imported first, sub-packages' modules included, a missing
    torch is explained; the torch-free ones (errors, goodput, inputs, chat, the CLI's parser,
    the loader, the sub-packages themselves) import."""
    code = """
import importlib, json, pkgutil, pagedkv.engine as pkg
result = {}
for info in pkgutil.walk_packages(pkg.__path__, prefix="pagedkv.engine."):
    name = info.name.removeprefix("pagedkv.engine.")
    try:
        importlib.import_module(info.name)
        result[name] = "ok"
    except ModuleNotFoundError as e:
        result[name] = f"{type(e).__name__}: {e}"
print(json.dumps(result))
"""
    res = _run(["torch"], code)
    assert res.returncode == 0, res.stderr
    result = json.loads(res.stdout)
    ok = {m for m, r in result.items() if r == "ok"}
    assert {"errors", "goodput", "inputs", "chat", "cli", "models", "virtual", "models.loader"} <= ok
    failing = {m: r for m, r in result.items() if r != "ok"}
    assert {"engine", "models.model", "virtual.manager", "runner", "sampling", "config"} <= set(failing)
    expected = (
        'MissingDependencyError: pagedkv.engine needs torch, which is not installed: pip install "pagedkv[engine]"'
    )
    assert all(r == expected for r in failing.values()), failing


def test_extra_packages_match_pyproject() -> None:
    tomllib = pytest.importorskip("tomllib")
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    for extra, modules in EXTRA_PACKAGES.items():
        assert extra in extras, extra
        names = {re.split(r"[<>=!~;\[ ]", req, maxsplit=1)[0].lower().replace("-", "_") for req in extras[extra]}
        assert modules <= names, (extra, modules - names)


def test_optional_imports_leaves_other_errors_alone() -> None:
    # A module that is not a package of the extra (a bug, a broken install) propagates as it is.
    with pytest.raises(ModuleNotFoundError) as info, optional_imports("pagedkv.kernels", "torch"):
        import pagedkv_no_such_module  # type: ignore[import-not-found]  # noqa: F401
    assert type(info.value) is ModuleNotFoundError
    with pytest.raises(KeyError), optional_imports("pagedkv.kernels", "no-such-extra"):
        pass


def test_missing_dependency_error_is_an_import_error_that_pickles() -> None:
    err = pagedkv.MissingDependencyError(
        'pagedkv.kernels needs torch, which is not installed: pip install "pagedkv[torch]"',
        name="torch",
        feature="pagedkv.kernels",
        extra="torch",
    )
    assert isinstance(err, ModuleNotFoundError) and isinstance(err, pagedkv.PagedKVError)
    back = pickle.loads(pickle.dumps(err))
    assert type(back) is pagedkv.MissingDependencyError
    assert (str(back), back.name, back.feature, back.extra) == (str(err), "torch", "pagedkv.kernels", "torch")


@pytest.mark.parametrize("package", ["ray", "torch", "transformers"])
def test_cluster_cli_names_the_ray_extra_for_ray_and_the_engine(package: str) -> None:
    """`pip install pagedkv` installs ``pagedkv-cluster``; without Ray or the engine's packages it
    exits 2 with one line naming the ``ray`` extra (which installs both), not a traceback."""
    res = _run([package], "from pagedkv.cluster.cli import main\nsys.exit(main(['--prompts', 'none.txt']))")
    assert res.returncode == 2, res.stderr
    assert res.stderr == (
        f'pagedkv.cluster: pagedkv-cluster needs {package}, which is not installed: pip install "pagedkv[ray]"\n'
    )
    assert {"ray", "msgspec"} | EXTRA_PACKAGES["engine"] <= EXTRA_PACKAGES["ray"]
