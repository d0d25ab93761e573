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


def _docs() -> dict[str, str]:
    """README.md and every Markdown file under docs/, by repository-relative path."""
    root = README.parent
    paths = [README, *sorted((root / "docs").rglob("*.md"))]
    return {p.relative_to(root).as_posix(): p.read_text(encoding="utf-8") for p in paths}


def test_docs_name_only_engine_modules_and_source_files_that_exist() -> None:
    # Moving a module must update the prose that names it: every `pagedkv.engine.X[.Y]` whose
    # X is lower-case must be a module or sub-package there (or a name pagedkv.engine exports),
    # and every repository path of a Python or Markdown file must exist.
    import pagedkv.engine

    root = README.parent
    engine = root / "python" / "pagedkv" / "engine"
    missing = []
    for doc, text in _docs().items():
        for dotted in set(re.findall(r"pagedkv\.engine\.([a-z_][a-z0-9_]*(?:\.[a-z_][a-z0-9_]*)?)", text)):
            head, _, sub = dotted.partition(".")
            if head in pagedkv.engine.__all__:
                continue
            pkg = engine / head
            if (engine / f"{head}.py").exists():
                continue  # sub is an attribute of the module
            if pkg.is_dir() and (not sub or (pkg / f"{sub}.py").exists()):
                continue
            missing.append(f"{doc}: pagedkv.engine.{dotted}")
        for path in set(
            re.findall(r"\b((?:python|tests|benchmarks|scripts|kernels|docs|examples)/[\w/.-]+\.(?:py|md))", text)
        ):
            # tests/v1/...: vLLM's own test files, inside its sdist (make test-vllm-upstream).
            if not (root / path).exists() and not path.startswith("tests/v1/"):
                missing.append(f"{doc}: {path}")
        for path in set(re.findall(r"(?<![\w/])(pagedkv/[\w/]+\.py)", text)):
            if not (root / "python" / path).exists():
                missing.append(f"{doc}: {path}")
    assert not missing, missing


def test_design_index_lists_every_chapter_and_each_chapter_is_one_section() -> None:
    root = README.parent
    index = (root / "docs" / "design.md").read_text(encoding="utf-8")
    listed = re.findall(r"\| ([^|]+?) \| \[design/([\w-]+\.md)\]\(design/\2\) \|", index)
    chapters = sorted(p.name for p in (root / "docs" / "design").glob("*.md"))
    assert sorted(name for _, name in listed) == chapters
    for section, name in listed:
        text = (root / "docs" / "design" / name).read_text(encoding="utf-8")
        assert text.startswith(f"# {section}\n"), name
        assert not re.search(r"(?m)^# ", text.split("\n", 1)[1]), f"{name} holds more than one section"


def test_docs_hold_no_merge_leftovers() -> None:
    # A merge tool's backup of a conflicted chapter (``*.orig``, ``*.rej``) is no chapter: the
    # index test above only globs ``*.md``, so a stale copy of old text would ship unnoticed.
    docs = README.parent / "docs"
    leftovers = sorted(str(p.relative_to(docs)) for p in docs.rglob("*") if p.suffix in (".orig", ".rej", ".BACKUP"))
    assert leftovers == []
