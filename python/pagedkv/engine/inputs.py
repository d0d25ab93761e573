"""Request inputs for the CLI and benchmarks: prompt files and request-length traces.

Prompt files:
- ``.txt``: one prompt per non-empty line;
- ``.jsonl``: one JSON object per line with ``"prompt"`` (text) or ``"messages"`` (chat), and
  optional ``"id"``, ``"system"``, ``"max_tokens"``, ``"cache_salt"``.

Trace files (token counts of real requests, no text; see ``benchmarks/data/``):
- CSV with ``ContextTokens,GeneratedTokens`` (Azure LLM inference trace) or
  ``num_prefill_tokens,num_decode_tokens`` (Sarathi / Vidur);
- JSONL with ``input_length`` / ``output_length`` (Mooncake).
Trace requests become synthetic token-id prompts (seeded, reproducible) with ``ignore_eos`` so
each generates exactly its recorded output length.
"""

from __future__ import annotations

import csv
import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from .errors import PromptFileError

__all__ = ["TraceRequest", "read_prompts", "read_trace", "synthetic_prompt"]


def _open_text(path: Path) -> list[str]:
    try:
        return path.read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        raise PromptFileError(f"prompts file {str(path)!r} does not exist") from None
    except (OSError, UnicodeDecodeError) as e:
        raise PromptFileError(f"cannot read prompts file {str(path)!r}: {e}") from None


def read_prompts(path: str | Path) -> list[Any]:
    """Prompts of a ``.txt`` or ``.jsonl`` file: strings (txt) or dicts (jsonl).

    Raises:
        PromptFileError: the file is missing or unreadable, has an unknown suffix, a JSONL line
            is not a JSON object with a non-empty ``"prompt"`` string or ``"messages"`` list,
            or the file holds no prompt (message names the file and the 1-based line).
    """
    p = Path(path)
    if p.suffix.lower() not in (".txt", ".jsonl"):
        raise PromptFileError(f"prompts file {str(p)!r} must end in .txt or .jsonl (got {p.suffix!r})")
    lines = _open_text(p)
    prompts: list[Any] = []
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        if p.suffix.lower() == ".txt":
            prompts.append(line)
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise PromptFileError(f"{p}:{lineno}: not valid JSON ({e.msg})") from None
        if not isinstance(obj, dict):
            raise PromptFileError(f"{p}:{lineno}: expected a JSON object, got {type(obj).__name__}")
        if "messages" in obj:
            msgs = obj["messages"]
            if not isinstance(msgs, list) or not msgs or not all(
                    isinstance(m, dict) and isinstance(m.get("content"), str) for m in msgs):
                raise PromptFileError(f"{p}:{lineno}: 'messages' must be a non-empty list of "
                                      f"{{'role', 'content'}} objects")
        elif not isinstance(obj.get("prompt"), str) or not obj["prompt"]:
            raise PromptFileError(f"{p}:{lineno}: needs a non-empty string 'prompt' (or 'messages'), "
                                  f"got {obj.get('prompt')!r}")
        if "max_tokens" in obj and (not isinstance(obj["max_tokens"], int) or obj["max_tokens"] < 1):
            raise PromptFileError(f"{p}:{lineno}: max_tokens={obj['max_tokens']!r} must be an integer >= 1")
        prompts.append(obj)
    if not prompts:
        raise PromptFileError(f"prompts file {str(p)!r} holds no prompt")
    return prompts


@dataclass(frozen=True)
class TraceRequest:
    """One traced request: prompt and output lengths in tokens."""

    prompt_tokens: int
    output_tokens: int


_COLUMNS = (("ContextTokens", "GeneratedTokens"), ("num_prefill_tokens", "num_decode_tokens"),
            ("input_length", "output_length"))


def read_trace(path: str | Path, *, limit: Optional[int] = None, scale: float = 1.0,
               max_prompt_tokens: Optional[int] = None, max_output_tokens: Optional[int] = None) -> list[TraceRequest]:
    """Request lengths of a trace file (see the module docs), in file order.

    Args:
        limit: keep the first ``limit`` requests.
        scale: multiply every length by this factor (rounded, at least 1) -- "scaled to fit" a
            small model or machine while keeping the shape of the distribution.
        max_prompt_tokens, max_output_tokens: clamp each length after scaling.

    Raises:
        PromptFileError: missing/unreadable file, unknown columns, non-integer lengths (names
            the file and line), or no request.
    """
    p = Path(path)
    lines = _open_text(p)
    rows: list[tuple[int, Any, Any]] = []
    if p.suffix.lower() == ".jsonl":
        for lineno, line in enumerate(lines, 1):
            if line.strip():
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError as e:
                    raise PromptFileError(f"{p}:{lineno}: not valid JSON ({e.msg})") from None
                if not isinstance(obj, dict):
                    raise PromptFileError(f"{p}:{lineno}: expected a JSON object")
                rows.append((lineno, obj.get("input_length"), obj.get("output_length")))
    else:
        reader = csv.DictReader(lines)
        cols = next((c for c in _COLUMNS if reader.fieldnames and set(c) <= set(reader.fieldnames)), None)
        if cols is None:
            raise PromptFileError(f"trace {str(p)!r}: columns {reader.fieldnames} have none of the known "
                                  f"length pairs {[list(c) for c in _COLUMNS]}")
        for lineno, row in enumerate(reader, 2):
            rows.append((lineno, row.get(cols[0]), row.get(cols[1])))
    out: list[TraceRequest] = []
    for lineno, a, b in rows:
        try:
            pt, ot = int(float(a)), int(float(b))
        except (TypeError, ValueError):
            raise PromptFileError(f"{p}:{lineno}: lengths {a!r}, {b!r} are not integers") from None
        pt, ot = max(1, round(pt * scale)), max(1, round(ot * scale))
        if max_prompt_tokens:
            pt = min(pt, max_prompt_tokens)
        if max_output_tokens:
            ot = min(ot, max_output_tokens)
        out.append(TraceRequest(pt, ot))
        if limit is not None and len(out) >= limit:
            break
    if not out:
        raise PromptFileError(f"trace {str(p)!r} holds no request")
    return out


def synthetic_prompt(num_tokens: int, vocab_size: int, seed: int) -> list[int]:
    """Deterministic pseudo-random token ids ``[num_tokens]`` in ``[100, vocab_size)`` (low ids,
    often special tokens, are avoided)."""
    rng = random.Random(seed)
    lo = min(100, vocab_size - 1)
    return [rng.randrange(lo, vocab_size) for _ in range(num_tokens)]
