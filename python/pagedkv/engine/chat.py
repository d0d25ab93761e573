"""Chat messages: the one rule for a valid ``messages`` list (used by the engine's intake and the
prompts-file reader) and rendering through the tokenizer's chat template. No torch import."""

from __future__ import annotations

from typing import Any

from pagedkv._repr import short_repr

from .errors import InvalidRequestError

__all__ = ["MESSAGES_FORMAT", "valid_messages", "render_chat"]

#: What :func:`valid_messages` accepts, for error messages.
MESSAGES_FORMAT = "a non-empty list of {'role': str, 'content': str} objects (role non-empty)"


def valid_messages(messages: Any) -> bool:
    """True for a non-empty list or tuple of dicts, each with a non-empty str ``"role"`` and a
    str ``"content"`` (other keys allowed). O(len(messages))."""
    return (
        isinstance(messages, (list, tuple))
        and bool(messages)
        and all(
            isinstance(m, dict)
            and isinstance(m.get("role"), str)
            and bool(m["role"])
            and isinstance(m.get("content"), str)
            for m in messages
        )
    )


def render_chat(tokenizer: Any, messages: list[dict[str, Any]]) -> tuple[str | None, list[int]]:
    """``(last message's content, token ids)`` of ``messages`` rendered by the tokenizer's chat
    template with the assistant generation prompt (no extra special tokens: the template has
    them).

    Raises:
        InvalidRequestError: the tokenizer has no chat template, or the template rejected the
            messages (e.g. roles that must alternate); the message quotes them, shortened.
    """
    if getattr(tokenizer, "chat_template", None) is None:
        raise InvalidRequestError("the tokenizer has no chat template; use chat_template=False")
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    except Exception as e:  # a template's own check: the request's fault
        raise InvalidRequestError(f"the chat template rejected messages {short_repr(messages)}: {e}") from e
    ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
    return str(messages[-1]["content"]), ids
