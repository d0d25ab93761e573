"""The cache identity of an engine: one digest of everything besides the token ids that decides
what K/V a block holds, used as the chain seed of its prefix-cache block hashes.

Within one engine the token ids and the cache salt decide whether two requests share a block.
Once hashes leave the process (KV events read by a router's :class:`pagedkv.KVIndexer`, an
index over several engines, a cache shared or offloaded between workers), two engines that
serve different models must never produce equal hashes for equal token ids. So every engine
derives a :class:`CacheIdentity` from what it loaded:

================= ========================================================================
part              what is digested (SHA-256, hex)
================= ========================================================================
``weights``       the model config (canonical JSON; file paths, the transformers version and
                  the dtype field left out) and every tensor of the state dict in name
                  order: name, dtype, shape and bytes, floating-point tensors as cast to the
                  engine's dtype (so a model loaded at fp32 and served at bf16 digests like
                  the same files loaded at bf16); a tensor sharing another's storage, e.g. a
                  tied LM head, is named with the one it aliases, not hashed twice
``tokenizer``     the tokenizer class, its special tokens and its full serialized form (a
                  fast tokenizer's ``tokenizers`` JSON: vocabulary, merges, normalizer,
                  pre-tokenizer, post-processor, added tokens; padding and truncation, which
                  are call-time state, left out); a slow one's sorted vocabulary
``chat_template`` the chat template text(s), or ``"none"``
``adapter``       the LoRA adapter, or ``"none"``: the reference engine loads none (an adapter
                  merged into the weights shows in ``weights``; a per-request adapter of
                  another engine is the core's ``adapter_id`` extra key)
``kv_dtype``      dtype of the KV cache (the engine's compute dtype): ``"float32"``...
``rope``          the RoPE parameters (``rope_type``, ``rope_theta``, scaling; canonical JSON)
================= ========================================================================

plus the format tag :data:`IDENTITY_FORMAT`. The digest is SHA-256 over the canonical JSON of
these parts; its 32 bytes are the ``hash_seed`` of the engine's :class:`pagedkv.CacheConfig`,
folded once into the root of every hash chain (``rust/core/src/hashing.rs``), so a block's
hash costs the same as before and engines with different identities produce unrelated hash
families. Two engines started separately on the same files at the same settings compute the
same identity, hence the same block hashes. (The per-prompt RoPE variant of length-dependent
RoPE stays a per-block extra key, see :mod:`pagedkv.engine.models.rope`.)

Left out on purpose: the device and attention kernel (CPU reference vs Triton), whose K/V
differ only by float rounding, as batch composition does; the block size and hash algorithm,
which already give different hashes (and the indexer checks the block size).

Cost: hashing the weights reads every tensor once (0.4 to 1.0 s, by machine load, for
SmolLM2-135M's 513 MiB of fp32 tensors on one core). For a model loaded from files the weights
digest is cached, keyed by the loaded files' paths, inodes, sizes, mtimes and ctimes (a file
rewritten in place with its size and mtime restored still has a new ctime), the dtype and the
transformers version, next to the loader's GGUF conversion cache (``$PAGEDKV_CACHE_DIR`` or
``~/.cache/pagedkv/gguf/``, folder ``weights-digests/``), so later starts skip it.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import EngineConfigError
from . import loader
from .loader import file_version

__all__ = [
    "IDENTITY_FORMAT",
    "IDENTITY_PARTS",
    "CacheIdentity",
    "cached_weights_digest",
    "source_file_versions",
    "chat_template_digest",
    "tokenizer_digest",
    "weights_digest",
]

#: Version tag of the identity's definition: a change to what is digested bumps it.
IDENTITY_FORMAT = "pagedkv-cache-identity/1"

#: The parts of an identity, in the order they are shown.
IDENTITY_PARTS = ("weights", "tokenizer", "chat_template", "adapter", "kv_dtype", "rope")

#: Config fields that name where or how a model was loaded, not what it computes.
_CONFIG_BOOKKEEPING = frozenset(
    {
        "_name_or_path",
        "_model_name_or_path",
        "_commit_hash",
        "transformers_version",
        "dtype",
        "torch_dtype",
        "output_attentions",
        "output_hidden_states",
        "return_dict",
        "use_cache",
    }
)


def _canonical(obj: Any) -> bytes:
    """Canonical JSON bytes (sorted keys, no spaces; non-JSON values by ``str``)."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), default=str, ensure_ascii=False).encode()


def _sha256_hex(data: bytes | str) -> str:
    return hashlib.sha256(data.encode() if isinstance(data, str) else data).hexdigest()


@dataclass(frozen=True)
class CacheIdentity:
    """What besides token ids decides a block's K/V (see the module docs for each part).

    Build it with :meth:`of_engine_inputs`, or from its parts (``CacheIdentity(parts)``).

    Attributes:
        parts: part name -> its value (hex digests, ``"none"``, a dtype name, RoPE JSON), the
            keys :data:`IDENTITY_PARTS`, in that order.
        digest: SHA-256 hex of the canonical JSON of :data:`IDENTITY_FORMAT` and ``parts``
            (computed, not passed).

    Raises:
        EngineConfigError: a part missing or unknown, or a value that is not a non-empty str.
    """

    parts: Mapping[str, str]
    digest: str = field(init=False)

    def __post_init__(self) -> None:
        if not isinstance(self.parts, Mapping):
            raise EngineConfigError(f"cache identity parts={self.parts!r} is invalid: expected a mapping")
        missing = [p for p in IDENTITY_PARTS if p not in self.parts]
        unknown = [p for p in self.parts if p not in IDENTITY_PARTS]
        if missing or unknown:
            raise EngineConfigError(
                f"cache identity parts are invalid: missing {missing}, unknown {unknown}; "
                f"expected exactly {list(IDENTITY_PARTS)}"
            )
        for name in IDENTITY_PARTS:
            value = self.parts[name]
            if not isinstance(value, str) or not value:
                raise EngineConfigError(f"cache identity part {name}={value!r} is invalid: expected a non-empty str")
        parts = {name: self.parts[name] for name in IDENTITY_PARTS}
        object.__setattr__(self, "parts", parts)
        object.__setattr__(self, "digest", _sha256_hex(_canonical({"format": IDENTITY_FORMAT, **parts})))

    @property
    def seed(self) -> bytes:
        """The 32 digest bytes: the ``hash_seed`` of the engine's :class:`pagedkv.CacheConfig`."""
        return bytes.fromhex(self.digest)

    def as_dict(self) -> dict[str, Any]:
        """``{"format", "digest", "parts": {...}}`` for results files and logs (JSON-ready)."""
        return {"format": IDENTITY_FORMAT, "digest": self.digest, "parts": dict(self.parts)}

    def describe(self) -> str:
        """One line: the digest's first 16 hex digits and each part (digests shortened)."""
        shown = [f"{k}={v[:12] if len(v) == 64 else v}" for k, v in self.parts.items()]
        return f"{self.digest[:16]} ({', '.join(shown)})"

    @classmethod
    def of_engine_inputs(
        cls, hf_model: Any, tokenizer: Any, *, kv_dtype: Any, rope: Mapping[str, Any], weights: str | None = None
    ) -> CacheIdentity:
        """The identity of an engine serving ``hf_model`` (a transformers causal LM) with
        ``tokenizer`` and a KV cache of ``kv_dtype`` (a torch dtype or its name); ``rope`` is
        the config's RoPE parameters (:func:`pagedkv.engine.models.rope.rope_parameters`);
        ``weights`` a precomputed :func:`weights_digest` (computed here when ``None``).

        Raises:
            EngineConfigError: ``hf_model`` has no ``state_dict``/``config``, or ``tokenizer``
                nothing to digest (names what is missing).
        """
        return cls(
            {
                "weights": weights if weights is not None else weights_digest(hf_model, kv_dtype),
                "tokenizer": tokenizer_digest(tokenizer),
                "chat_template": chat_template_digest(tokenizer),
                "adapter": "none",
                "kv_dtype": str(kv_dtype).removeprefix("torch."),
                "rope": _canonical(dict(rope)).decode(),
            }
        )


def weights_digest(hf_model: Any, dtype: Any = None) -> str:
    """SHA-256 hex of a transformers model's config and state dict (see the module docs), its
    floating-point tensors as cast to ``dtype`` (the engine's compute dtype: a torch dtype or
    its name; ``None``: as they are). O(bytes of the weights); tensors on another device or
    dtype are converted one at a time.

    Raises:
        EngineConfigError: ``hf_model`` has no ``config`` with ``to_dict`` or no ``state_dict``;
            ``dtype`` is not a dtype the engine serves.
    """
    import torch

    from ..config import torch_dtype

    target = None if dtype is None else torch_dtype(dtype)

    config: Any = getattr(hf_model, "config", None)
    if not hasattr(config, "to_dict") or not callable(getattr(hf_model, "state_dict", None)):
        raise EngineConfigError(
            f"model={type(hf_model).__name__} is invalid for a cache identity: expected a transformers "
            f"model with .config.to_dict() and .state_dict()"
        )
    h = hashlib.sha256(b"pkv:weights:1\0")
    cfg = {k: v for k, v in config.to_dict().items() if k not in _CONFIG_BOOKKEEPING}
    h.update(_canonical(cfg) + b"\0")
    seen: dict[tuple[int, int, tuple[int, ...], tuple[int, ...], str], str] = {}
    for name, tensor in sorted(hf_model.state_dict().items()):
        t = tensor.detach()
        # An alias (tied embedding / LM head) is named, not hashed again.
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), tuple(t.stride()), str(t.dtype))
        as_dtype = target if target is not None and t.is_floating_point() else t.dtype
        head = _canonical([name, str(as_dtype).removeprefix("torch."), list(t.shape)])
        h.update(len(head).to_bytes(8, "little") + head)
        if key in seen:
            h.update(b"A" + seen[key].encode() + b"\0")
            continue
        seen[key] = name
        data = t.to("cpu", as_dtype).contiguous().reshape(-1).view(torch.uint8).numpy()
        h.update(b"T" + data.nbytes.to_bytes(8, "little"))
        h.update(data)
    return h.hexdigest()


def tokenizer_digest(tokenizer: Any) -> str:
    """SHA-256 hex of a tokenizer: class name, special tokens, and the fast tokenizer's full
    serialization without its padding and truncation settings (else the sorted vocabulary).
    Deterministic across processes, and unchanged by earlier ``tokenizer(..., padding=...,
    truncation=...)`` calls.

    Raises:
        EngineConfigError: the tokenizer has neither a ``backend_tokenizer`` nor ``get_vocab``.
    """
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and hasattr(backend, "to_str"):
        # Padding and truncation are call-time state of the backend (transformers switches them
        # on for `tokenizer(..., padding=True)` and leaves them on), not part of the text -> ids
        # map: an engine built after such a call must get the same digest.
        if getattr(backend, "padding", None) is not None or getattr(backend, "truncation", None) is not None:
            backend = type(backend).from_str(backend.to_str())
            backend.no_padding()
            backend.no_truncation()
        body = backend.to_str()
    elif callable(getattr(tokenizer, "get_vocab", None)):
        body = _canonical(sorted(tokenizer.get_vocab().items(), key=lambda kv: (kv[1], kv[0]))).decode()
    else:
        raise EngineConfigError(
            f"tokenizer={type(tokenizer).__name__} is invalid for a cache identity: expected a "
            f"transformers tokenizer (backend_tokenizer or get_vocab)"
        )
    special = getattr(tokenizer, "special_tokens_map", None) or {}
    head = _canonical([type(tokenizer).__name__, dict(special)])
    return _sha256_hex(head + b"\0" + body.encode())


def chat_template_digest(tokenizer: Any) -> str:
    """SHA-256 hex of the tokenizer's chat template (a str, or named templates as a dict), or
    ``"none"`` when it has none."""
    template = getattr(tokenizer, "chat_template", None)
    if not template:
        return "none"
    return _sha256_hex(template if isinstance(template, str) else _canonical(template))


# ---- the on-disk cache of weights digests ----------------------------------------------------


def _source_files(model_path: Any, convert_cache: bool = True) -> list[Path] | None:
    """The files a load of ``model_path`` reads weights and config from (the converted folder's
    files for a cached GGUF), or ``None`` when that cannot be told."""
    try:
        src = loader._usable_source(loader.resolve_model_path(model_path), convert_cache)
    except Exception:  # the load itself reports these
        return None
    if src.gguf_file:
        return [src.folder / src.gguf_file]
    return sorted(p for p in src.folder.iterdir() if p.is_file() and not p.name.startswith("."))


def source_file_versions(model_path: Any) -> list[tuple[str, int, int, int, int, int]] | None:
    """:func:`file_version` of every file a load of ``model_path`` reads, or ``None`` when
    they cannot be told. Taken before the load, it lets :func:`cached_weights_digest` see a
    file rewritten while the model was loading (the loaded weights are then of neither
    version the cache could name)."""
    files = _source_files(model_path)
    if not files:
        return None
    try:
        return [file_version(f) for f in files]
    except OSError:
        return None


def _digest_cache_file(stats: list[tuple[str, int, int, int, int, int]], dtype: Any) -> Path:
    import transformers

    key = _sha256_hex(_canonical([IDENTITY_FORMAT, str(dtype), transformers.__version__, stats]))
    return loader._cache_root() / "weights-digests" / f"{key[:32]}.json"


def cached_weights_digest(
    hf_model: Any,
    model_path: Any,
    dtype: Any,
    versions_before_load: list[tuple[str, int, int, int, int, int]] | None = None,
) -> str:
    """:func:`weights_digest` of a model loaded from ``model_path`` (``None``: the default
    model) at ``dtype``, read from the digest cache when the files are unchanged (see the
    module docs), else computed and stored. A cache that cannot be read or written is skipped.

    ``versions_before_load`` is :func:`source_file_versions` taken before the model was
    loaded. When the files differ from it now, one of them changed during the load: the
    digest is computed and neither read from nor stored in the cache, since the cache key
    (the versions now) may not name the weights that were loaded.

    Raises:
        EngineConfigError: see :func:`weights_digest`.
    """
    files = _source_files(model_path)
    if not files:
        return weights_digest(hf_model, dtype)
    try:
        stats = [file_version(f) for f in files]
    except OSError:  # a file vanished since the load: no cache entry
        return weights_digest(hf_model, dtype)
    if versions_before_load is not None and versions_before_load != stats:
        return weights_digest(hf_model, dtype)  # rewritten during the load
    path = _digest_cache_file(stats, dtype)
    try:
        cached = json.loads(path.read_text())["weights"]
        if isinstance(cached, str) and len(cached) == 64 and all(c in "0123456789abcdef" for c in cached):
            return cached
    except (OSError, ValueError, KeyError, TypeError):
        pass
    digest = weights_digest(hf_model, dtype)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        _prune(path.parent)
        fd, tmp = tempfile.mkstemp(prefix=path.name, dir=path.parent)
        with os.fdopen(fd, "w") as f:
            json.dump({"weights": digest, "files": [str(p.resolve()) for p in files]}, f)
        os.replace(tmp, path)
    except OSError:  # a read-only cache folder: just recompute next time
        pass
    return digest


def _prune(folder: Path) -> None:
    """Drop the entries of models whose files are gone (temporary model folders), so the cache
    holds no more entries than there are models on disk. O(entries), on a cache miss only."""
    for entry in folder.glob("*.json"):
        try:
            files = json.loads(entry.read_text())["files"]
            if all(Path(f).exists() for f in files):
                continue
        except (OSError, ValueError, KeyError, TypeError):
            pass  # unreadable: dropped too
        entry.unlink(missing_ok=True)
