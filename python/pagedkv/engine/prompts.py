"""Request intake: a prompt (text, token ids, chat messages or a prompt dict) and its arguments,
checked and tokenized into a :class:`PreparedRequest` without touching any engine state."""

from __future__ import annotations

import dataclasses
import numbers
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from pagedkv._repr import short_repr

from .chat import MESSAGES_FORMAT, render_chat, valid_messages
from .errors import InvalidRequestError
from .sampling import SamplingParams

__all__ = ["PromptType", "PreparedRequest", "PromptProcessor", "batch_items", "check_unique_ids"]

#: A prompt: text, token ids, or a dict with ``"prompt"`` (text) or ``"messages"`` (chat) and
#: optional ``"id"``, ``"system"``, ``"max_tokens"``, ``"cache_salt"``.
PromptType = str | Sequence[int] | dict[str, Any]


@dataclass(frozen=True)
class PreparedRequest:
    """A request that passed every check of :meth:`PromptProcessor.prepare`, ready to queue.

    Attributes:
        text: the prompt text (``None`` for token ids).
        token_ids: the tokenized prompt.
        params: its sampling parameters.
        request_id: the caller's id, or ``None`` for the arrival number.
        cache_salt: prefix-cache salt, or ``None``.
    """

    text: str | None
    token_ids: list[int]
    params: SamplingParams
    request_id: str | None
    cache_salt: str | None


def _token_ids(prompt: Any) -> list[int]:
    """A token-id prompt as a list of ints (a list, tuple, range, or 1-D integer array/tensor).

    Raises:
        InvalidRequestError: any other type (``None``, an int, bytes...), or an item that is
            not an integer: a float is not truncated, a bool is not a token id.
    """
    if hasattr(prompt, "tolist") and not isinstance(prompt, (list, tuple)):  # numpy / torch
        prompt = prompt.tolist()
    if not isinstance(prompt, (list, tuple, range)):
        raise InvalidRequestError(
            f"prompt {short_repr(prompt)} is invalid: expected a str, a list of token ids "
            f"or a dict with 'prompt' or 'messages' (got {type(prompt).__name__})"
        )
    for t in prompt:
        if not isinstance(t, numbers.Integral) or isinstance(t, (bool, np.bool_)):
            raise InvalidRequestError(f"prompt token id {t!r} is invalid: expected an int (got {type(t).__name__})")
    return [int(t) for t in prompt]


class PromptProcessor:
    """Checks and tokenizes prompts for one model.

    Args:
        tokenizer: the model's tokenizer (``__call__``, ``apply_chat_template``).
        vocab_size: token ids must lie in ``[0, vocab_size)``.
    """

    def __init__(self, tokenizer: Any, vocab_size: int) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size

    def tokenize(
        self, prompt: PromptType, *, chat_template: bool = False, system_prompt: str | None = None
    ) -> tuple[str | None, list[int]]:
        """Prompt text (or ``None``) and its token ids.

        ``prompt`` is a non-empty str, a non-empty list / tuple (or 1-D integer array or
        tensor) of int token ids, or a dict (see :data:`PromptType`) whose ``"messages"`` is a
        non-empty list of ``{"role": str, "content": str}`` dicts. With ``chat_template`` a
        text prompt becomes one user message (after ``system_prompt``) rendered by the
        tokenizer's chat template with the assistant generation prompt.

        Raises:
            InvalidRequestError: empty prompt; a prompt of another type (``None``, an int,
                bytes...); a token id that is not an int (floats are not truncated, bools are
                not ids) or is outside the vocabulary; a bad dict, malformed messages or
                messages the chat template rejects. The message names the prompt or value.
        """
        if system_prompt is not None and not isinstance(system_prompt, str):
            raise InvalidRequestError(f"system_prompt={short_repr(system_prompt)} is invalid: expected a str or None")
        if isinstance(prompt, dict):
            system_prompt = prompt.get("system", system_prompt)
            if system_prompt is not None and not isinstance(system_prompt, str):
                raise InvalidRequestError(f"prompt {short_repr(prompt)} has an invalid 'system': expected a str")
            if "messages" in prompt and "prompt" in prompt:
                # As in a prompts file: which of the two was meant is not ours to guess.
                raise InvalidRequestError(
                    f"prompt dict {short_repr(prompt)} has both 'prompt' and 'messages'; give one"
                )
            if "messages" in prompt:
                if not valid_messages(prompt["messages"]):
                    raise InvalidRequestError(
                        f"prompt {short_repr(prompt)} has malformed 'messages': expected {MESSAGES_FORMAT}"
                    )
                messages = [dict(m) for m in prompt["messages"]]
                if system_prompt and not any(m["role"] == "system" for m in messages):
                    messages.insert(0, {"role": "system", "content": system_prompt})
                return render_chat(self.tokenizer, messages)
            if "prompt" not in prompt:
                raise InvalidRequestError(f"prompt dict {short_repr(prompt)} has neither 'prompt' nor 'messages'")
            prompt = prompt["prompt"]
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequestError("prompt is empty ('')")
            if chat_template:
                messages = [{"role": "user", "content": prompt}]
                if system_prompt:
                    messages.insert(0, {"role": "system", "content": system_prompt})
                return prompt, render_chat(self.tokenizer, messages)[1]
            text = prompt if system_prompt is None else f"{system_prompt}\n\n{prompt}"
            return prompt, list(self.tokenizer(text)["input_ids"])
        ids = _token_ids(prompt)
        if not ids:
            raise InvalidRequestError("prompt is empty ([] token ids)")
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise InvalidRequestError(f"prompt token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})")
        return None, ids

    def prepare(
        self,
        prompt: PromptType,
        params: Any,
        request_id: Any,
        cache_salt: Any,
        chat_template: bool,
        system_prompt: str | None,
    ) -> PreparedRequest:
        """Check and tokenize one request (see :meth:`pagedkv.engine.LLMEngine.add_request`);
        a dict prompt's ``"id"`` is used when ``request_id`` is ``None``, and its
        ``"cache_salt"`` and ``"max_tokens"`` win over ``cache_salt`` and
        ``params.max_tokens``. Changes no state.

        Raises:
            InvalidRequestError: a bad prompt, ``params`` not a :class:`SamplingParams` or
                ``None``, ``cache_salt`` not a str or ``None``, a request id that is not a
                non-empty str or an int, a dict's ``"max_tokens"`` that is not an int >= 1.
        """
        if params is None:
            params = SamplingParams()
        elif not isinstance(params, SamplingParams):
            raise InvalidRequestError(
                f"params={short_repr(params)} is invalid: expected a SamplingParams or None "
                f"(got {type(params).__name__})"
            )
        text, ids = self.tokenize(prompt, chat_template=chat_template, system_prompt=system_prompt)
        if isinstance(prompt, dict):
            request_id = request_id if request_id is not None else prompt.get("id")
            cache_salt = prompt.get("cache_salt", cache_salt)
            if "max_tokens" in prompt:  # SamplingParams checks the value
                params = dataclasses.replace(params, max_tokens=prompt["max_tokens"])
        # The same ids a prompts file accepts; anything else would be silently str()-ed.
        if request_id is not None and (
            isinstance(request_id, bool) or not isinstance(request_id, (str, int)) or request_id == ""
        ):
            raise InvalidRequestError(
                f"request_id={short_repr(request_id)} is invalid: expected a non-empty str or an int"
            )
        if cache_salt is not None and not isinstance(cache_salt, str):
            raise InvalidRequestError(f"cache_salt={short_repr(cache_salt)} is invalid: expected a str or None")
        return PreparedRequest(text, ids, params, None if request_id is None else str(request_id), cache_salt)


def batch_items(prompts: Any, params: Any) -> list[tuple[Any, Any]]:
    """``(prompt, params)`` pairs of a batch call (see :meth:`pagedkv.engine.LLMEngine.generate`):
    ``prompts`` a list of prompts or one text or dict; ``params`` one :class:`SamplingParams`
    (or ``None``) for all, or a list / tuple with one per prompt. Items are checked later.

    Raises:
        InvalidRequestError: ``prompts`` or ``params`` of another type, or a params list whose
            length differs from the prompts'.
    """
    if isinstance(prompts, (str, dict)):
        items: list[Any] = [prompts]
    elif prompts is None or isinstance(prompts, (bytes, bytearray)) or not isinstance(prompts, Iterable):
        raise InvalidRequestError(
            f"prompts={short_repr(prompts)} is invalid: expected a list of prompts "
            "(texts, token-id lists or dicts) or one text or dict"
        )
    else:
        items = list(prompts)
    if params is None or isinstance(params, SamplingParams):
        plist: list[Any] = [params] * len(items)
    elif isinstance(params, (list, tuple)):
        plist = list(params)
    else:
        raise InvalidRequestError(
            f"params={short_repr(params)} is invalid: expected a SamplingParams, a "
            f"list of them (one per prompt) or None (got {type(params).__name__})"
        )
    if len(plist) != len(items):
        raise InvalidRequestError(f"got {len(plist)} SamplingParams for {len(items)} prompts")
    return list(zip(items, plist))


def check_unique_ids(prepared: Sequence[PreparedRequest]) -> None:
    """Raises InvalidRequestError naming the first request id given twice in one batch."""
    seen: set[str] = set()
    for p in prepared:
        if p.request_id is not None:
            if p.request_id in seen:
                raise InvalidRequestError(f"request_id {p.request_id!r} appears twice in prompts")
            seen.add(p.request_id)
