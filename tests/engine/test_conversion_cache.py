"""The loader's GGUF conversion cache stays bounded: a conversion (cache miss) removes the
converted folders whose source GGUF file is gone or changed, and nothing else. The conversion
itself (a minute for SmolLM2) is replaced by a stub that writes the same files; the real one
runs in the ``smol`` tests."""

from __future__ import annotations

import json
import os
import tempfile
import time
from pathlib import Path

import pytest

from pagedkv.engine.models import loader
from pagedkv.engine.models.loader import ModelSource


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


def test_a_gguf_rewritten_in_place_with_size_and_mtime_kept_is_converted_again(
    tmp_path: Path, cache_root: Path, conversions: list[Path]
):
    """``cp -p`` / ``tar x`` / a reproducible build rewrite a GGUF file in place and restore its
    mtime, and another quantization of the same model can have the same size: keyed by path,
    size and mtime, the old model's conversion was served for the new file. The ctime (which
    no user-space call can set back) and the inode key it now, and the old conversion is
    pruned when the new one is made."""
    src = _gguf(tmp_path / "venv", b"GGUF old weights")
    target = src.folder / "model.gguf"
    first = loader._usable_source(src, convert_cache=True).folder
    before = target.stat()
    with open(target, "r+b") as f:  # in place: same inode, same size, other bytes
        f.write(b"GGUF new weights")
    os.utime(target, ns=(before.st_atime_ns, before.st_mtime_ns))
    # The ctime moves on at the kernel's clock tick: wait for it rather than race it.
    while target.stat().st_ctime_ns == before.st_ctime_ns:
        time.sleep(0.01)
        os.utime(target, ns=(before.st_atime_ns, before.st_mtime_ns))
    after = target.stat()
    assert (after.st_ino, after.st_size, after.st_mtime_ns) == (before.st_ino, before.st_size, before.st_mtime_ns)
    second = loader._usable_source(src, convert_cache=True).folder
    assert second != first
    assert conversions == [first, second]
    assert sorted(cache_root.iterdir()) == [second]
    assert loader._usable_source(src, convert_cache=True).folder == second  # then a hit again
    assert conversions == [first, second]


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
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        (legacy / name).write_bytes(b"old")
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


def _user_folder(path: Path, *names: str) -> Path:
    path.mkdir(parents=True)
    for name in names:
        (path / name).write_bytes(b"user data")
    return path


def test_prune_never_removes_what_it_did_not_convert(tmp_path: Path, cache_root: Path):
    """PAGEDKV_CACHE_DIR pointed at a folder of the user's: folders named like a conversion
    (a model id plus a 16-hex commit prefix) but holding anything a conversion does not write,
    symlinks to folders elsewhere, files, and a stale conversion's symlinks are all kept."""
    elsewhere = _user_folder(tmp_path / "models" / "m-0123456789abcdef", "config.json", "model.safetensors")
    kept = [
        # a model snapshot of the user's: a conversion's files plus a README
        _user_folder(cache_root / "mymodel-1a2b3c4d5e6f7a8b", "config.json", "model.safetensors", "README.md"),
        _user_folder(cache_root / "foo-0123456789abcdef", "notes.txt"),  # no weights
        _user_folder(cache_root / "w-00000000000000cd", "model.safetensors"),  # no config.json
        _user_folder(cache_root / "x-00000000000000ce", "config.json", "model-00001-of-00002.safetensors"),
    ]
    nested = _user_folder(cache_root / "y-00000000000000cf", "config.json", "model.safetensors")
    _user_folder(nested / "checkpoints", "model.safetensors")  # a subfolder: not a conversion
    kept.append(nested)
    link = cache_root / "link-00000000000000ab"
    link.symlink_to(elsewhere)  # looks like a legacy conversion through the link; still kept
    file = cache_root / "bar-00000000000000ac"
    file.write_text("a file, not a folder")
    # A stale conversion of ours holding a symlink out: the link goes, never its target.
    stale = _user_folder(cache_root / "model-00000000000000ad", "config.json", "model.safetensors")
    (stale / loader._SOURCE_RECORD).write_text(
        json.dumps({"path": str(tmp_path / "gone.gguf"), "size": 1, "mtime_ns": 1})
    )
    (stale / "escape").symlink_to(elsewhere)
    # Another process's conversion of that same gone file, not yet renamed into place.
    in_flight = Path(tempfile.mkdtemp(prefix=stale.name + ".tmp", dir=cache_root))
    for f in stale.iterdir():
        if f.is_file() and not f.is_symlink():
            (in_flight / f.name).write_bytes(f.read_bytes())

    assert loader._prune_stale_conversions(cache_root) == [stale]
    assert sorted(cache_root.iterdir()) == sorted([*kept, link, file, in_flight])
    assert len(list(in_flight.iterdir())) == 3
    assert sorted(p.name for p in elsewhere.iterdir()) == ["config.json", "model.safetensors"]
    assert all(sorted(p.name for p in k.iterdir()) for k in kept)


def test_a_source_that_cannot_be_read_is_not_taken_for_gone(
    tmp_path: Path, cache_root: Path, monkeypatch: pytest.MonkeyPatch
):
    src = _gguf(tmp_path / "m")
    conversion = _user_folder(cache_root / "model-0123456789abcdef", "config.json", "model.safetensors")
    (conversion / loader._SOURCE_RECORD).write_text(json.dumps(loader._source_stamp(src.folder / "model.gguf")))
    real_stamp = loader._source_stamp

    def no_permission(f: Path) -> dict[str, object]:
        raise PermissionError(13, "Permission denied", str(f))

    monkeypatch.setattr(loader, "_source_stamp", no_permission)
    assert loader._prune_stale_conversions(cache_root) == [] and conversion.exists()
    monkeypatch.setattr(loader, "_source_stamp", real_stamp)
    (src.folder / "model.gguf").unlink()
    assert loader._prune_stale_conversions(cache_root) == [conversion]


def test_a_cache_it_cannot_prune_does_not_fail_the_load(
    tmp_path: Path, cache_root: Path, conversions: list[Path], monkeypatch: pytest.MonkeyPatch
):
    """A read-only cache (rmtree fails) or an unreadable one (listing fails): nothing is
    reported removed and the conversion goes ahead."""
    stale = _user_folder(cache_root / "model-0123456789abcdef", "config.json", "model.safetensors")
    monkeypatch.setattr(loader.shutil, "rmtree", lambda path, ignore_errors=False: None)
    assert loader._prune_stale_conversions(cache_root) == [] and stale.exists()

    def unreadable(self: Path) -> object:
        raise PermissionError(13, "Permission denied", str(self))

    monkeypatch.setattr(Path, "iterdir", unreadable)
    assert loader._prune_stale_conversions(cache_root) == []
    src = _gguf(tmp_path / "m")
    assert loader._usable_source(src, convert_cache=True).folder == conversions[0]


def test_a_source_through_a_symlink_or_a_relative_path_keeps_its_conversion(
    tmp_path: Path, cache_root: Path, conversions: list[Path], monkeypatch: pytest.MonkeyPatch
):
    real = _gguf(tmp_path / "store")
    (tmp_path / "venv").mkdir()
    (tmp_path / "venv" / "model.gguf").symlink_to(real.folder / "model.gguf")
    monkeypatch.chdir(tmp_path)
    through_link = loader._usable_source(ModelSource(Path("venv"), "model.gguf"), convert_cache=True).folder
    # The record names the real file, absolute: a later prune from elsewhere keeps it.
    record = json.loads((through_link / loader._SOURCE_RECORD).read_text())
    assert record["path"] == str((real.folder / "model.gguf").resolve())
    monkeypatch.chdir(cache_root)
    assert loader._prune_stale_conversions(cache_root) == []
    assert loader._usable_source(real, convert_cache=True).folder == through_link  # same key
    # The link removed, the real file stays: the conversion is still of a live file.
    (tmp_path / "venv" / "model.gguf").unlink()
    assert loader._prune_stale_conversions(cache_root) == [] and conversions == [through_link]


def test_a_killed_conversions_temporary_folder_goes_after_an_hour(tmp_path: Path, cache_root: Path):
    """A conversion killed midway leaves its ``*.tmp*`` folder (up to 0.5 GB); one untouched for
    over an hour is removed, a recent one (a conversion in progress) and look-alikes are kept."""
    cache_root.mkdir()
    old = time.time() - loader.ABANDONED_AFTER_S - 60

    def folder(name: str, mtime: float) -> Path:
        path = cache_root / name
        path.mkdir()
        (path / "model.safetensors").write_bytes(b"half written")
        os.utime(path, (mtime, mtime))
        return path

    abandoned = folder("model-0123456789abcdef.tmpk2j4x_1", old)
    in_progress = folder("model-fedcba9876543210.tmpa8b7c6", time.time())
    not_ours = folder("notes.tmpold", old)  # not named after a conversion
    elsewhere = folder("elsewhere", old)
    link = cache_root / "model-00000000000000aa.tmplink"
    link.symlink_to(elsewhere)
    a_file = cache_root / "model-00000000000000bb.tmpfile"
    a_file.write_bytes(b"x")
    os.utime(a_file, (old, old))
    assert loader._prune_stale_conversions(cache_root) == [abandoned]
    assert sorted(cache_root.iterdir()) == sorted([in_progress, not_ours, elsewhere, link, a_file])
