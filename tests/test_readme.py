"""The README's Python example runs as written and prints what its comments say."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

README = Path(__file__).resolve().parent.parent / "README.md"


def readme_example() -> str:
    text = README.read_text(encoding="utf-8")
    block = re.search(r"<!-- README_EXAMPLE_START -->\s*```python\n(.*?)```\s*<!-- README_EXAMPLE_END -->", text, re.S)
    assert block, "README.md lost its example markers"
    return block.group(1)


def test_readme_example_runs() -> None:
    res = subprocess.run([sys.executable, "-c", readme_example()], capture_output=True, text=True, check=False)
    assert res.returncode == 0, res.stderr
    lines = res.stdout.splitlines()
    assert lines[0] == "unknown sequence id 3"
    assert lines[1].startswith("CacheStats(num_blocks=64, block_size=16, used=0, free=63, cached_free=2,")


def test_readme_quickstart_is_exactly_two_commands() -> None:
    text = README.read_text(encoding="utf-8")
    quick = text.split("## Quickstart", 1)[1].split("\n## ", 1)[0]
    block = re.search(r"```bash\n(.*?)```", quick, re.S)
    assert block
    commands = [line.split("#", 1)[0].strip() for line in block.group(1).splitlines() if line.strip()]
    assert commands == ["make run", "make test"]


def test_readme_names_every_extra_and_what_make_setup_installs() -> None:
    import tomllib

    root = README.parent
    text = README.read_text(encoding="utf-8")
    pyproject = tomllib.loads((root / "pyproject.toml").read_text(encoding="utf-8"))
    extras = set(pyproject["project"]["optional-dependencies"])
    library = text.split("As a library:", 1)[1].split("\n\n", 1)[0]
    assert set(re.findall(r"`\[(\w+)\]`", library)) == extras
    makefile = (root / "Makefile").read_text(encoding="utf-8")
    installed = re.search(r'-e "\.\[([\w,]+)\]"', makefile)
    assert installed, "Makefile lost its editable install of the extras"
    setup = re.search(r"`make setup`: (.*?) extras", text, re.S)
    assert setup
    assert set(re.findall(r"`(\w+)`", setup.group(1))) == set(installed.group(1).split(","))
