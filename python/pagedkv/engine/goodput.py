"""Goodput: the share and rate of requests that meet a latency target (service level objective).

Throughput alone rewards a runtime that finishes many requests late; serving papers judge it by
*goodput* instead, the requests that meet both a time-to-first-token (TTFT) and a time-per-
output-token (TPOT) target (DistServe, Zhong et al., OSDI'24; the same view as the SLO
attainment of Sarathi-Serve, Agrawal et al., OSDI'24). Definitions, shared by the engine's
metrics, the ``pagedkv-engine`` stats table and ``benchmarks/engine_throughput.py``:

- TTFT: seconds from a request's arrival (queueing) to its first generated token.
- TPOT: seconds per output token after the first, ``(finish - first token) / (tokens - 1)``,
  over the request's first completion -- the mean inter-token time of that request, not a
  per-token maximum. A request with one output token has no TPOT (``None``).
- A request *meets* the objective when ``TTFT <= ttft_s`` and ``TPOT <= tpot_s`` (both
  inclusive); a request without a TPOT (one output token) is judged on its TTFT alone.
- Goodput share: good requests / finished requests (0 when none finished); goodput rate: good
  requests per second of the run's wall time (0 for an empty or zero-length window).

Torch-free, so the CLI checks its ``--slo-*`` flags and benchmarks score any system with it.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from .errors import EngineConfigError

__all__ = ["ServiceLevelObjective", "DEFAULT_SLO", "Goodput", "time_per_output_token", "goodput"]


@dataclass(frozen=True)
class ServiceLevelObjective:
    """Latency targets a request must meet to count towards goodput (seconds).

    The defaults are an interactive chat target: the first token within 2 s, then at least 10
    tokens/s per request (0.1 s per token, faster than people read).

    Attributes:
        ttft_s: time-to-first-token target, seconds, finite and > 0.
        tpot_s: time-per-output-token target, seconds, finite and > 0.

    Raises:
        EngineConfigError: a target that is not a finite real number > 0 (``0``, negative, NaN,
            infinity, an int too large for a float, a bool or a string); the message names the
            field and the value. Accepted targets are stored as ``float`` (numpy scalars too).
    """

    ttft_s: float = 2.0
    tpot_s: float = 0.1

    def __post_init__(self) -> None:
        for name in ("ttft_s", "tpot_s"):
            value = getattr(self, name)
            seconds = math.nan
            if isinstance(value, numbers.Real) and not isinstance(value, (bool, np.bool_)):
                try:  # numpy scalars too; an int too large for a float is not finite
                    seconds = float(value)
                except OverflowError:
                    pass
            if not (math.isfinite(seconds) and seconds > 0):
                shown = repr(value) if len(repr(value)) <= 40 else repr(value)[:37] + "..."
                raise EngineConfigError(f"ServiceLevelObjective {name}={shown} must be a finite number of seconds > 0")
            object.__setattr__(self, name, seconds)

    def is_met(self, ttft_s: float, tpot_s: float | None) -> bool:
        """Whether a request with these latencies (seconds; ``tpot_s`` ``None`` for a
        one-token output) meets both targets (inclusive)."""
        return ttft_s <= self.ttft_s and (tpot_s is None or tpot_s <= self.tpot_s)


#: The targets used when none are given (``pagedkv-engine``'s ``--slo-ttft`` / ``--slo-tpot``).
DEFAULT_SLO = ServiceLevelObjective()


def time_per_output_token(first_token_time: float, finish_time: float, num_output_tokens: int) -> float | None:
    """TPOT in seconds: ``(finish_time - first_token_time) / (num_output_tokens - 1)``, or
    ``None`` when ``num_output_tokens < 2`` (no token after the first). Times in seconds on one
    clock (``time.perf_counter()``)."""
    if num_output_tokens < 2:
        return None
    return (finish_time - first_token_time) / (num_output_tokens - 1)


@dataclass(frozen=True)
class Goodput:
    """Goodput of a set of finished requests.

    Attributes:
        good_requests: requests meeting both targets.
        num_requests: requests judged.
        share: ``good_requests / num_requests`` (0.0 when ``num_requests == 0``).
        requests_per_s: ``good_requests / elapsed_s`` (0.0 when ``elapsed_s <= 0``).
    """

    good_requests: int
    num_requests: int
    share: float
    requests_per_s: float


def goodput(
    ttft_s: Sequence[float], tpot_s: Sequence[float | None], slo: ServiceLevelObjective, elapsed_s: float
) -> Goodput:
    """Goodput of requests given per request TTFT and TPOT (seconds, same order, ``None`` TPOT
    for one-token outputs) over a window of ``elapsed_s`` seconds of wall time.

    Raises:
        ValueError: ``ttft_s`` and ``tpot_s`` differ in length.
    """
    if len(ttft_s) != len(tpot_s):
        raise ValueError(f"goodput: {len(ttft_s)} TTFT values but {len(tpot_s)} TPOT values")
    good = sum(slo.is_met(t, p) for t, p in zip(ttft_s, tpot_s))
    n = len(ttft_s)
    return Goodput(
        good_requests=good,
        num_requests=n,
        share=good / n if n else 0.0,
        requests_per_s=good / elapsed_s if elapsed_s > 0 else 0.0,
    )
