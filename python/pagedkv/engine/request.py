"""Engine-side state of requests and their sequences, and the per-request result.

A *request* is one prompt with its :class:`SamplingParams`; it owns one or more *sequences*
(the samples of ``n > 1`` or the beams of beam search), each registered in the
:class:`pagedkv.KVCacheManager` under its own ``seq_id``. Sequences of one request share the
prompt's KV blocks (fork + copy-on-write) and are preempted together.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from .goodput import time_per_output_token
from .sampling import SamplingParams

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from .beam_search import BeamSearch

__all__ = ["Sequence", "Request", "CompletionOutput", "RequestOutput"]


@dataclass(eq=False)
class Sequence:
    """One token stream of a request: the engine's own view of it.

    What the KV cache manager owns -- how many tokens have KV, which blocks the sequence holds,
    whether it is swapped out -- is not mirrored here; the scheduler asks the manager.

    Attributes:
        seq_id: the id used with the KV cache manager.
        token_ids: prompt + generated tokens (all tokens known to the engine).
        num_prompt_tokens: length of the prompt, in tokens.
        pending: sampled tokens not yet handed to the manager (sent with the next step, or
            appended before a preemption).
        sample_index: index among the request's samples (seeds its generator).
        generator: seeded generator for random sampling (``None`` for greedy).
        finish_reason: ``"eos"``, ``"stop"``, ``"length"`` or ``None`` while running.
        stop_text: the output text cut before the stop string that ended it, else ``None``.
        logprobs: beam search only: the fp32 ``[vocab]`` log-probs of the next token, kept until
            every beam of the request has them.
        drafts: speculative decoding only: the draft tokens the scheduler proposes for this
            step's verify (set and consumed within one ``schedule`` call; see
            :attr:`ScheduledBatch.drafts <pagedkv.engine.scheduler.ScheduledBatch.drafts>`).
    """

    seq_id: int
    token_ids: list[int]
    num_prompt_tokens: int
    pending: list[int] = field(default_factory=list)
    sample_index: int = 0
    generator: torch.Generator | None = None
    finish_reason: str | None = None
    stop_text: str | None = None
    logprobs: torch.Tensor | None = None
    drafts: list[int] = field(default_factory=list)

    @property
    def output_token_ids(self) -> list[int]:
        """Generated tokens (after the prompt)."""
        return self.token_ids[self.num_prompt_tokens :]

    def add_token(self, token: int) -> None:
        """Append a sampled token (handed to the manager with the next step)."""
        self.token_ids.append(token)
        self.pending.append(token)


@dataclass(eq=False)
class Request:
    """One prompt being served (see the module docs).

    Attributes:
        request_id: caller-visible id.
        prompt: the prompt text (``None`` when token ids were given).
        prompt_token_ids: the prompt, tokenized.
        params: sampling parameters.
        arrival_index: FCFS order (smaller = older).
        arrival_time: ``time.perf_counter()`` when added, seconds.
        seed: seed of the request's sampling generators.
        seqs: live sequences (registered in the manager).
        seq_ids: ids of every sequence ever created for the request (forks included), so an
            abort can free whatever the manager still holds for it.
        finished_seqs: completed samples.
        beam: beam search state (beam search only).
        forked: ``n > 1`` sampling only: the prompt's sequence was forked into the n samples.
        num_preemptions: how many times the request was preempted (recompute or swap).
        num_cached_tokens: prompt tokens served from the prefix cache at its first scheduling.
        prefill_reserved: set by the scheduler from admission until the prefill is done (the
            blocks of the remaining prefill are reserved; the last choice as a preemption victim).
        first_token_time: ``time.perf_counter()`` of the first sampled token, or ``None``.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_index: int
    arrival_time: float
    seed: int = 0
    seqs: list[Sequence] = field(default_factory=list)
    seq_ids: list[int] = field(default_factory=list)
    finished_seqs: list[Sequence] = field(default_factory=list)
    beam: BeamSearch | None = None
    forked: bool = False
    num_preemptions: int = 0
    num_cached_tokens: int | None = None
    prefill_reserved: bool = False
    first_token_time: float | None = None


@dataclass(frozen=True)
class CompletionOutput:
    """One generated continuation.

    Attributes:
        index: sample index (0 for greedy; beam rank for beam search, best first).
        text: decoded output (special tokens skipped; cut before a matched stop string).
        token_ids: generated token ids (the EOS token included when it ended the output). When
            a stop string ended it, these still include the tokens of the stop string (and any
            text after it in the last token) although ``text`` is cut before it -- as in vLLM.
        finish_reason: ``"eos"``, ``"stop"`` (stop string) or ``"length"`` (max tokens or
            model context).
        score: beam search score (length-normalised log-prob), else ``None``.
    """

    index: int
    text: str
    token_ids: tuple[int, ...]
    finish_reason: str
    score: float | None = None


@dataclass(frozen=True)
class RequestOutput:
    """The result of one request.

    Attributes:
        request_id: the request's id.
        prompt: prompt text (``None`` for token-id prompts).
        prompt_token_ids: the prompt as token ids.
        outputs: the completions (``n`` of them).
        num_cached_tokens: prompt tokens served from the prefix cache, in tokens.
        num_preemptions: times the request was preempted.
        arrival_time, first_token_time, finish_time: ``time.perf_counter()`` seconds.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: tuple[int, ...]
    outputs: tuple[CompletionOutput, ...]
    num_cached_tokens: int
    num_preemptions: int
    arrival_time: float
    first_token_time: float
    finish_time: float

    @property
    def text(self) -> str:
        """Text of the first completion."""
        return self.outputs[0].text

    @property
    def token_ids(self) -> tuple[int, ...]:
        """Token ids of the first completion."""
        return self.outputs[0].token_ids

    @property
    def finish_reason(self) -> str:
        """Finish reason of the first completion."""
        return self.outputs[0].finish_reason

    @property
    def ttft_s(self) -> float:
        """Time to first token, seconds: arrival (queueing) to the first generated token."""
        return self.first_token_time - self.arrival_time

    @property
    def tpot_s(self) -> float | None:
        """Time per output token after the first, seconds, over the first completion (see
        :func:`pagedkv.engine.goodput.time_per_output_token`); ``None`` for one output token."""
        return time_per_output_token(self.first_token_time, self.finish_time, len(self.token_ids))

    def to_dict(self) -> dict[str, object]:
        """JSON-ready dict (the CLI's ``--output`` line)."""
        first = self.outputs[0]
        return {
            "id": self.request_id,
            "prompt": self.prompt,
            "num_prompt_tokens": len(self.prompt_token_ids),
            "output_text": first.text,
            "output_token_ids": list(first.token_ids),
            "finish_reason": first.finish_reason,
            "outputs": [
                {
                    "index": o.index,
                    "text": o.text,
                    "token_ids": list(o.token_ids),
                    "finish_reason": o.finish_reason,
                    "score": o.score,
                }
                for o in self.outputs
            ],
            "cached_prompt_tokens": self.num_cached_tokens,
            "preemptions": self.num_preemptions,
            "ttft_s": self.ttft_s,
            "tpot_s": self.tpot_s,
            "latency_s": self.finish_time - self.arrival_time,
        }
