"""What the engine returns: when a sequence stops (EOS, a stop string, a length limit) and the
:class:`~pagedkv.engine.request.RequestOutput` of a finished request."""

from __future__ import annotations

from typing import Any

from .beam_search import BeamSearch
from .request import CompletionOutput, Request, RequestOutput, Sequence
from .sampling import SamplingParams

__all__ = ["OutputProcessor"]


class OutputProcessor:
    """Stop checks and output assembly for one tokenizer.

    Args:
        tokenizer: decodes generated tokens (special tokens skipped).
        eos_token_ids: tokens that end a sequence unless ``ignore_eos``.
        max_model_len: a sequence stops at this many tokens (prompt included).
    """

    def __init__(self, tokenizer: Any, eos_token_ids: frozenset[int], max_model_len: int) -> None:
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len

    def stop_text(self, token_ids: list[int], stops: tuple[str, ...]) -> str | None:
        """The decoded text of generated ``token_ids`` (special tokens skipped) cut before the
        earliest stop string in it, or ``None`` when it contains none. One decode per call."""
        text = self.tokenizer.decode(token_ids, skip_special_tokens=True)
        hits = [text.find(s) for s in stops if s in text]
        return text[: min(hits)] if hits else None

    def finish_reason(self, seq: Sequence, params: SamplingParams) -> str | None:
        """Why ``seq`` stops after its newest token -- ``"eos"``, ``"stop"`` (then
        ``seq.stop_text`` is set) or ``"length"``, in that precedence -- or ``None``."""
        if not params.ignore_eos and seq.token_ids[-1] in self.eos_token_ids:
            return "eos"
        if params.stop:
            seq.stop_text = self.stop_text(seq.output_token_ids, params.stop)
            if seq.stop_text is not None:
                return "stop"
        if len(seq.token_ids) - seq.num_prompt_tokens >= params.max_tokens or len(seq.token_ids) >= self.max_model_len:
            return "length"
        return None

    def beam_search(self, params: SamplingParams) -> BeamSearch:
        """The beam search state of a request with ``params`` (EOS and stop strings as here)."""
        stops = params.stop
        return BeamSearch(
            params.beam_width,
            params.max_tokens,
            () if params.ignore_eos else sorted(self.eos_token_ids),
            params.length_penalty,
            params.early_stopping,
            stop=(lambda toks: self.stop_text(toks, stops) is not None) if stops else None,
        )

    def request_output(self, req: Request, now: float) -> RequestOutput:
        """The result of finished request ``req`` (``now``: its finish time, perf_counter s)."""
        decode = self.tokenizer.decode
        outs: list[CompletionOutput] = []
        if req.beam is not None:
            p = req.params
            for rank, (toks, score) in enumerate(req.beam.best(p.n)):
                # Same precedence as finish_reason: EOS, then a stop string (text cut before it), then length.
                stop_text = self.stop_text(toks, p.stop) if p.stop else None
                if toks and toks[-1] in self.eos_token_ids and not p.ignore_eos:
                    reason, text = "eos", decode(toks, skip_special_tokens=True)
                elif stop_text is not None:
                    reason, text = "stop", stop_text
                else:
                    reason, text = "length", decode(toks, skip_special_tokens=True)
                outs.append(CompletionOutput(rank, text, tuple(toks), reason, score))
        else:
            for s in sorted(req.finished_seqs, key=lambda s: s.sample_index):
                text = s.stop_text if s.stop_text is not None else decode(s.output_token_ids, skip_special_tokens=True)
                outs.append(
                    CompletionOutput(s.sample_index, text, tuple(s.output_token_ids), s.finish_reason or "length")
                )
        return RequestOutput(
            req.request_id,
            req.prompt,
            tuple(req.prompt_token_ids),
            tuple(outs),
            req.num_cached_tokens or 0,
            req.num_preemptions,
            req.arrival_time,
            req.first_token_time or now,
            now,
        )
