"""The loader's GGUF conversion cache stays bounded: a conversion (cache miss) removes the
converted folders whose source GGUF file is gone or changed, and nothing else. The conversion
itself (a minute for SmolLM2) is replaced by a stub that writes the same files; the real one
runs in the ``smol`` tests."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from pagedkv.engine import loader
from pagedkv.engine.loader import ModelSource


@pytest.fixture
def cache_root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    root = tmp_path / "cache"
    monkeypatch.setenv("PAGEDKV_CACHE_DIR", str(root))
    return root


@pytest.fixture
def conversions(monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    """Replace the dequantization by writing the files a conversion leaves (config, weights,
    source record); returns the list of folders converted."""
    done: list[Path] = []

    def fake_convert(src: ModelSource, dest: Path) -> None:
        assert src.gguf_file is not None
        dest.mkdir(parents=True)
        (dest / "config.json").write_text("{}")
        (dest / "model.safetensors").write_bytes(b"weights")
        (dest / loader._SOURCE_RECORD).write_text(json.dumps(loader._source_stamp(src.folder / src.gguf_file)))
        done.append(dest)

    monkeypatch.setattr(loader, "_convert_gguf", fake_convert)
    return done


def _gguf(folder: Path, data: bytes = b"GGUF v3") -> ModelSource:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "model.gguf").write_bytes(data)
    return ModelSource(folder, "model.gguf")


def test_a_reinstalled_gguf_replaces_its_old_conversion(tmp_path: Path, cache_root: Path, conversions: list[Path]):
    src = _gguf(tmp_path / "venv")
    first = loader._usable_source(src, convert_cache=True).folder
    assert loader._usable_source(src, convert_cache=True).folder == first  # a hit converts nothing
    assert conversions == [first]

    # A reinstall rewrites the file (new mtime): the old conversion goes when the new one is made.
    os.utime(src.folder / "model.gguf", ns=(1, 10**18))
    second = loader._usable_source(src, convert_cache=True).folder
    assert second != first
    assert conversions == [first, second]
    assert sorted(cache_root.iterdir()) == [second]


def test_conversions_of_deleted_files_go_and_live_ones_stay(tmp_path: Path, cache_root: Path, conversions: list[Path]):
    kept = loader._usable_source(_gguf(tmp_path / "a"), convert_cache=True).folder
    gone_src = _gguf(tmp_path / "b", b"other model")
    gone = loader._usable_source(gone_src, convert_cache=True).folder
    (gone_src.folder / "model.gguf").unlink()  # e.g. a deleted virtual environment

    # Things in the cache root that are not a conversion of ours are never touched.
    unrelated = [cache_root / "weights-digests", cache_root / "notes", cache_root / "x-0123456789abcdef.tmpq1"]
    for folder in unrelated:
        folder.mkdir()
        (folder / "model.safetensors").write_bytes(b"not ours to delete")
    # A conversion written by an older pagedkv (no source record) is stale.
    legacy = cache_root / "model-fedcba9876543210"
    legacy.mkdir()
    (legacy / "model.safetensors").write_bytes(b"old")
    # A damaged record counts as stale too.
    damaged = cache_root / "model-00000000000000aa"
    damaged.mkdir()
    (damaged / loader._SOURCE_RECORD).write_text("[1, 2")

    third = loader._usable_source(_gguf(tmp_path / "c", b"third"), convert_cache=True).folder
    assert sorted(cache_root.iterdir()) == sorted([kept, third, *unrelated])
    assert not gone.exists()


def test_prune_reports_what_it_removed_and_tolerates_a_missing_root(tmp_path: Path, cache_root: Path):
    assert loader._prune_stale_conversions(cache_root) == []  # root not created yet
    src = _gguf(tmp_path / "m")
    stale = cache_root / "model-0123456789abcdef"
    stale.mkdir(parents=True)
    (stale / loader._SOURCE_RECORD).write_text(
        json.dumps({**loader._source_stamp(src.folder / "model.gguf"), "size": 1})
    )
    assert loader._prune_stale_conversions(cache_root) == [stale]
    assert not stale.exists()


def test_convert_cache_false_neither_converts_nor_prunes(tmp_path: Path, cache_root: Path, conversions: list[Path]):
    legacy = cache_root / "model-fedcba9876543210"
    legacy.mkdir(parents=True)
    (legacy / "model.safetensors").write_bytes(b"old")
    src = _gguf(tmp_path / "m")
    assert loader._usable_source(src, convert_cache=False) == src
    assert conversions == [] and legacy.exists()
