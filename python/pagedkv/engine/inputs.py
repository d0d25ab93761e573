"""Request inputs for the CLI and benchmarks: prompt files and request-length traces.

A reader module: it imports nothing of the CLI (the CLI passes its option names in).

Prompts files (``--prompts``), chosen by suffix:

- ``.txt``: one prompt per line, the whole line verbatim (no JSON, no escapes, so a prompt
  cannot span lines); blank lines are skipped. Request ids are the 0-based prompt positions
  ``"0"``, ``"1"``, ... (blank lines not counted).
- ``.jsonl``: one JSON object per line (blank lines skipped) with exactly one of

  - ``prompt``: non-empty string, the user's text;
  - ``messages``: non-empty list of ``{"role": str, "content": str}`` chat messages;

  and optionally

  - ``id``: non-empty string or integer (written as a string); default the 0-based prompt
    position. Ids must be unique in the file, defaults included;
  - ``system``: string, system prompt of this request (overrides ``--system``);
  - ``max_tokens``: integer >= 1 (overrides ``--max-tokens``);
  - ``cache_salt``: string, prefix-cache salt (overrides ``--cache-salt``): requests share
    cached KV blocks only when their salts are equal.

  Sampling settings (``temperature``, ``n``, ``stop``, ...) are CLI-wide and rejected on a
  line; any other key is ignored (free for your own metadata).

Every line is checked when the file is read, before a model is loaded: a bad line raises
:class:`~pagedkv.engine.errors.PromptFileError` naming ``file:line`` and the field.

Trace files (``--trace``; token counts of real requests, no text; see ``benchmarks/data/``):
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
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from types import MappingProxyType
from typing import Any

from pagedkv._repr import short_repr

from .chat import MESSAGES_FORMAT, valid_messages
from .errors import PromptFileError

__all__ = [
    "PROMPT_FIELDS",
    "TraceRequest",
    "TraceRow",
    "read_prompts",
    "read_trace",
    "read_trace_rows",
    "synthetic_prompt",
]


# The keys of a prompts JSONL line that mean something to the engine (see the module docs).
PROMPT_FIELDS = ("prompt", "messages", "id", "system", "max_tokens", "cache_salt")


def _open_text(path: Path, kind: str) -> list[str]:
    """Lines of the UTF-8 text file ``path``; ``kind`` ("prompts file", "trace file") names it
    in the error."""
    try:
        return path.read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        raise PromptFileError(f"{kind} {str(path)!r} does not exist") from None
    except (OSError, UnicodeDecodeError) as e:
        raise PromptFileError(f"cannot read {kind} {str(path)!r}: {e}") from None


def _sampling_fields(options: Mapping[str, str]) -> dict[str, str]:
    """SamplingParams fields other than ``max_tokens`` -> what to do instead of setting one on a
    prompts line (``options``: field -> the command-line option that sets it for every request).
    Read from the dataclass, so a new sampling field is rejected on a line without an edit here."""
    from dataclasses import fields

    from .sampling import SamplingParams  # imports torch: only when a JSONL file is read

    return {
        f.name: (
            f"use {options[f.name]} (it applies to every request)"
            if f.name in options
            else "it applies to every request"
        )
        for f in fields(SamplingParams)
        if f.name != "max_tokens"
    }


def _check_line(obj: dict[str, Any], where: str, sampling_flags: dict[str, str]) -> None:
    """Raise PromptFileError (prefixed with ``where`` = "file:line") for a field of the wrong
    type; see the module docs for the accepted types."""

    def kind(v: Any) -> str:
        return f"{type(v).__name__} {v!r}"

    if "messages" in obj:
        if "prompt" in obj:
            raise PromptFileError(f"{where}: has both 'prompt' and 'messages'; give one")
        msgs = obj["messages"]
        if not valid_messages(msgs):
            raise PromptFileError(f"{where}: 'messages' must be {MESSAGES_FORMAT}, got {short_repr(msgs, 200)}")
    elif not isinstance(obj.get("prompt"), str) or not obj["prompt"]:
        raise PromptFileError(f"{where}: needs a non-empty string 'prompt' (or 'messages'), got {obj.get('prompt')!r}")
    if "id" in obj:
        rid = obj["id"]
        if isinstance(rid, bool) or not isinstance(rid, (str, int)) or rid == "":
            raise PromptFileError(f"{where}: 'id' must be a non-empty string or an integer, got {kind(rid)}")
    for key in ("system", "cache_salt"):
        if key in obj and not isinstance(obj[key], str):
            raise PromptFileError(f"{where}: {key!r} must be a string, got {kind(obj[key])}")
    if "max_tokens" in obj:
        v = obj["max_tokens"]
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise PromptFileError(f"{where}: max_tokens={v!r} must be an integer >= 1")
    for key in obj:
        if key in sampling_flags:
            raise PromptFileError(
                f"{where}: {key!r} cannot be set per request in a prompts file; {sampling_flags[key]}"
            )


def read_prompts(path: str | Path, *, sampling_options: Mapping[str, str] = MappingProxyType({})) -> list[Any]:
    """Prompts of a ``.txt`` or ``.jsonl`` file (format in the module docs): strings (txt) or
    the line's dicts, unchanged (jsonl). O(file size).

    ``sampling_options`` maps a :class:`~pagedkv.engine.SamplingParams` field to the option
    that sets it for every request (e.g. ``{"temperature": "--temperature"}``); the error for
    that field on a line names it.

    Raises:
        PromptFileError: the file is missing or unreadable, has an unknown suffix, holds no
            prompt, or a JSONL line is not a JSON object, lacks a non-empty ``"prompt"`` string
            or ``"messages"`` list, has a field of the wrong type or a sampling field, or
            repeats an earlier line's request id (explicit or default). Line errors name the
            file and the 1-based line; a duplicate id names both lines.
    """
    p = Path(path)
    if p.suffix.lower() not in (".txt", ".jsonl"):
        raise PromptFileError(f"prompts file {str(p)!r} must end in .txt or .jsonl (got {p.suffix!r})")
    lines = _open_text(p, "prompts file")
    prompts: list[Any] = []
    # request id -> (line, explicit?): the CLI keys results by id, so a repeated id would
    # make one request's row overwrite another's.
    seen: dict[str, tuple[int, bool]] = {}
    sampling_flags = _sampling_fields(sampling_options) if p.suffix.lower() == ".jsonl" else {}
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        if p.suffix.lower() == ".txt":
            prompts.append(line)
            continue
        obj = _json_object(p, lineno, line)
        _check_line(obj, f"{p}:{lineno}", sampling_flags)
        explicit = "id" in obj
        rid = str(obj["id"]) if explicit else str(len(prompts))
        if rid in seen:
            first, first_explicit = seen[rid]
            note = (
                ""
                if explicit and first_explicit
                else '; a line without "id" gets its 0-based position among the prompts as id'
            )
            raise PromptFileError(f"{p}:{lineno}: duplicate request id {rid!r} (already used on line {first}{note})")
        seen[rid] = (lineno, explicit)
        prompts.append(obj)
    if not prompts:
        raise PromptFileError(f"prompts file {str(p)!r} holds no prompt")
    return prompts


def _json_object(path: Path, lineno: int, line: str) -> dict[str, Any]:
    """One JSONL line as a dict.

    Raises:
        PromptFileError: the line is not valid JSON or not an object (names file:line).
    """
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        raise PromptFileError(f"{path}:{lineno}: not valid JSON ({e.msg})") from None
    if not isinstance(obj, dict):
        raise PromptFileError(f"{path}:{lineno}: expected a JSON object, got {type(obj).__name__}")
    return obj


@dataclass(frozen=True)
class TraceRequest:
    """One traced request: prompt and output lengths in tokens."""

    prompt_tokens: int
    output_tokens: int


@dataclass(frozen=True)
class TraceRow:
    """One request of a trace file, as recorded.

    Attributes:
        line: 1-based line of the file it came from.
        prompt_tokens, output_tokens: recorded lengths in tokens (>= 0; traces hold rows with
            0 generated tokens).
        arrival_s: arrival time in seconds on the trace's own clock (Azure ``TIMESTAMP``,
            Mooncake ``timestamp`` in ms, Sarathi/Vidur ``arrived_at``), or ``None`` when the
            file has none for the row or it does not parse.
        hash_ids: Mooncake only: the request's block hash ids (one per 512-token block).
    """

    line: int
    prompt_tokens: int
    output_tokens: int
    arrival_s: float | None = None
    hash_ids: tuple[int, ...] | None = None


# Known CSV layouts: (prompt column, output column, arrival column or None).
_CSV_COLUMNS = (
    ("ContextTokens", "GeneratedTokens", "TIMESTAMP"),  # Azure LLM inference trace 2023
    ("num_prefill_tokens", "num_decode_tokens", "arrived_at"),  # Sarathi / Vidur
)


def _azure_time(text: str) -> float:
    """Seconds of an Azure ``TIMESTAMP`` such as ``2023-11-16 18:15:46.6805900`` (7 fractional
    digits, more than ``strptime``'s ``%f`` takes)."""
    head, _, frac = text.partition(".")
    return datetime.strptime(head, "%Y-%m-%d %H:%M:%S").timestamp() + (float("0." + frac) if frac else 0.0)


def read_trace_rows(path: str | Path, *, limit: int | None = None) -> list[TraceRow]:
    """Every request of a trace file (see the module docs) as recorded, in file order: the one
    reader of trace files, used by :func:`read_trace` and the benchmarks. O(rows read).

    Args:
        limit: stop after this many requests.

    Raises:
        PromptFileError: missing/unreadable file, unknown CSV columns, or lengths that are not
            integers (names the file and line).
    """
    p = Path(path)
    lines = _open_text(p, "trace file")
    out: list[TraceRow] = []

    def add(lineno: int, prompt: Any, output: Any, when: Any, parse_time: Any, hashes: Any = None) -> bool:
        try:
            pt, ot = int(float(prompt)), int(float(output))
        except (TypeError, ValueError):
            raise PromptFileError(f"{p}:{lineno}: lengths {prompt!r}, {output!r} are not integers") from None
        try:  # only the benchmarks read arrival times: one that does not parse is left out
            arrival = None if when in (None, "") else float(parse_time(when))
        except (TypeError, ValueError):
            arrival = None
        out.append(TraceRow(lineno, pt, ot, arrival, None if hashes is None else tuple(int(h) for h in hashes)))
        return limit is not None and len(out) >= limit

    if p.suffix.lower() == ".jsonl":
        for lineno, line in enumerate(lines, 1):
            if line.strip():
                obj = _json_object(p, lineno, line)
                ms = obj.get("timestamp")
                if add(
                    lineno,
                    obj.get("input_length"),
                    obj.get("output_length"),
                    ms,
                    lambda v: float(v) / 1000.0,
                    obj.get("hash_ids"),
                ):
                    break
        return out
    reader = csv.DictReader(lines)
    cols = next((c for c in _CSV_COLUMNS if reader.fieldnames and set(c[:2]) <= set(reader.fieldnames)), None)
    if cols is None:
        raise PromptFileError(
            f"trace {str(p)!r}: columns {reader.fieldnames} have none of the known "
            f"length pairs {[list(c[:2]) for c in _CSV_COLUMNS] + [['input_length', 'output_length']]}"
        )
    parse_time = _azure_time if cols[2] == "TIMESTAMP" else float
    for lineno, row in enumerate(reader, 2):
        if add(lineno, row.get(cols[0]), row.get(cols[1]), row.get(cols[2]), parse_time):
            break
    return out


def read_trace(
    path: str | Path,
    *,
    limit: int | None = None,
    scale: float = 1.0,
    max_prompt_tokens: int | None = None,
    max_output_tokens: int | None = None,
) -> list[TraceRequest]:
    """Request lengths of a trace file (see the module docs), in file order, scaled and clamped
    for serving (every length at least 1 token).

    Args:
        limit: keep the first ``limit`` requests.
        scale: multiply every length by this factor (rounded, at least 1) -- "scaled to fit" a
            small model or machine while keeping the shape of the distribution.
        max_prompt_tokens, max_output_tokens: clamp each length after scaling.

    Raises:
        PromptFileError: as :func:`read_trace_rows`, or a file with no request.
    """
    out: list[TraceRequest] = []
    for row in read_trace_rows(path, limit=limit):
        pt, ot = max(1, round(row.prompt_tokens * scale)), max(1, round(row.output_tokens * scale))
        if max_prompt_tokens:
            pt = min(pt, max_prompt_tokens)
        if max_output_tokens:
            ot = min(ot, max_output_tokens)
        out.append(TraceRequest(pt, ot))
    if not out:
        raise PromptFileError(f"trace {str(path)!r} holds no request")
    return out


def synthetic_prompt(num_tokens: int, vocab_size: int, seed: int) -> list[int]:
    """Deterministic pseudo-random token ids ``[num_tokens]`` in ``[100, vocab_size)`` (low ids,
    often special tokens, are avoided)."""
    rng = random.Random(seed)
    lo = min(100, vocab_size - 1)
    return [rng.randrange(lo, vocab_size) for _ in range(num_tokens)]
