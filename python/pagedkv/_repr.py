"""``short_repr``: the one place error messages shorten the values they quote."""

from __future__ import annotations

__all__ = ["short_repr"]


def short_repr(value: object, limit: int = 80) -> str:
    """``repr(value)`` cut to at most ``limit`` characters (``...`` marks the cut), so an error
    quoting a long prompt, chat history or array stays readable. ``limit`` >= 4."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
