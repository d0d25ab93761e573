"""Serving metrics of an engine run: throughput, latency percentiles, goodput against a service
level objective (:mod:`.goodput`) and what the KV cache manager did (utilisation, peak blocks,
prefix hits in either tier, prefill tokens computed, copies, swaps, host tier stores and loads,
preemptions)."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from .errors import EngineConfigError
from .goodput import DEFAULT_SLO, ServiceLevelObjective, goodput
from .request import RequestOutput

__all__ = ["EngineMetrics", "MetricsCollector"]


@dataclass(frozen=True)
class EngineMetrics:
    """Figures of one run (times in seconds, sizes in blocks unless named otherwise).

    Attributes:
        num_requests: finished requests.
        num_output_tokens: generated tokens over all completions.
        elapsed_s: wall time from the first scheduled step to the last finished request.
        requests_per_s, output_tokens_per_s: throughput over ``elapsed_s``.
        ttft_p50_s, ttft_p99_s: time to first token (arrival -> first sampled token).
        tpot_p50_s, tpot_p99_s: time per output token after the first (per request mean, over
            requests with at least two output tokens; see :mod:`.goodput`).
        slo_ttft_s, slo_tpot_s: the service level objective goodput was judged against.
        good_requests: finished requests meeting both targets (a one-token request: its TTFT).
        goodput_share: ``good_requests / num_requests`` (0.0 without requests).
        goodput_requests_per_s: ``good_requests / elapsed_s``.
        kv_utilization: mean over steps of (token slots holding KV / allocated slots).
        mean_blocks_used, peak_blocks_used: blocks referenced by sequences per step.
        usable_blocks: pool capacity (``num_blocks - 1``).
        prefix_hit_rate: prefix-cache hit tokens / queried prompt tokens.
        prefix_hit_tokens: prompt tokens served from the prefix cache.
        copies: copy-on-write block copies.
        swapped_out_blocks, swapped_in_blocks: blocks moved by swap preemption.
        preemptions: preemptions (recompute + swap).
        num_steps: scheduler steps.
        spec_verifies: speculative decoding: sequence verify steps (a sequence scored with at
            least one draft token in a step).
        spec_draft_tokens: draft tokens proposed and verified.
        spec_accepted_tokens: draft tokens accepted (each saves one decode step).
        spec_acceptance_rate: ``spec_accepted_tokens / spec_draft_tokens`` (0.0 without drafts).
        spec_tokens_per_verify: tokens emitted per verify step, the bonus token included
            (``1 + accepted / spec_verifies``; 0.0 without verifies).
        prefill_tokens: tokens the forward pass computed that were not decodes of a sampled
            token: prompt tokens not served from the prefix cache, plus everything a
            recompute-preempted request prefilled again (what a larger cache saves).
        host_hit_tokens: prompt tokens served from the prefix cache's host tier (loaded back
            instead of recomputed; included in ``prefix_hit_tokens``); 0 without a host tier.
        host_stored_blocks, host_loaded_blocks: blocks copied device -> host tier and back.
        host_blocks: host tier capacity in blocks (0: no host tier).
    """

    num_requests: int
    num_output_tokens: int
    elapsed_s: float
    requests_per_s: float
    output_tokens_per_s: float
    ttft_p50_s: float
    ttft_p99_s: float
    tpot_p50_s: float
    tpot_p99_s: float
    slo_ttft_s: float
    slo_tpot_s: float
    good_requests: int
    goodput_share: float
    goodput_requests_per_s: float
    kv_utilization: float
    mean_blocks_used: float
    peak_blocks_used: int
    usable_blocks: int
    prefix_hit_rate: float
    prefix_hit_tokens: int
    copies: int
    swapped_out_blocks: int
    swapped_in_blocks: int
    preemptions: int
    num_steps: int
    spec_verifies: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_acceptance_rate: float = 0.0
    spec_tokens_per_verify: float = 0.0
    prefill_tokens: int = 0
    host_hit_tokens: int = 0
    host_stored_blocks: int = 0
    host_loaded_blocks: int = 0
    host_blocks: int = 0

    def as_dict(self) -> dict[str, Any]:
        """Plain dict (JSON-ready)."""
        return asdict(self)

    def table_rows(self) -> list[tuple[str, str]]:
        """(label, formatted value) rows for a stats table."""
        ms = 1000.0
        host = (
            [
                (
                    "host tier: hit tokens / blocks stored / loaded",
                    f"{self.host_hit_tokens} / {self.host_stored_blocks} / {self.host_loaded_blocks} "
                    f"({self.host_blocks} blocks)",
                )
            ]
            if self.host_blocks
            else []
        )
        return [
            ("requests", f"{self.num_requests}"),
            ("output tokens", f"{self.num_output_tokens}"),
            ("elapsed", f"{self.elapsed_s:.2f} s"),
            ("requests/s", f"{self.requests_per_s:.2f}"),
            ("output tokens/s", f"{self.output_tokens_per_s:.1f}"),
            ("TTFT p50 / p99", f"{self.ttft_p50_s * ms:.0f} / {self.ttft_p99_s * ms:.0f} ms"),
            ("TPOT p50 / p99", f"{self.tpot_p50_s * ms:.1f} / {self.tpot_p99_s * ms:.1f} ms"),
            ("SLO targets", f"TTFT <= {self.slo_ttft_s:g} s, TPOT <= {self.slo_tpot_s:g} s"),
            (
                "goodput (both SLOs met)",
                f"{self.goodput_share:.1%} ({self.good_requests}/{self.num_requests} requests), "
                f"{self.goodput_requests_per_s:.2f} requests/s",
            ),
            ("KV utilization (mean)", f"{self.kv_utilization:.1%}"),
            (
                "blocks in use: mean / peak / usable",
                f"{self.mean_blocks_used:.0f} / {self.peak_blocks_used} / {self.usable_blocks}",
            ),
            ("prefix hit rate", f"{self.prefix_hit_rate:.1%} ({self.prefix_hit_tokens} tokens)"),
            ("prefill tokens computed", f"{self.prefill_tokens}"),
            *host,
            ("copy-on-write copies", f"{self.copies}"),
            ("swapped out / in (blocks)", f"{self.swapped_out_blocks} / {self.swapped_in_blocks}"),
            ("preemptions", f"{self.preemptions}"),
            ("steps", f"{self.num_steps}"),
        ] + (
            [
                (
                    "speculative drafts: accepted / proposed",
                    f"{self.spec_accepted_tokens} / {self.spec_draft_tokens} ({self.spec_acceptance_rate:.1%}), "
                    f"{self.spec_tokens_per_verify:.2f} tokens per verify",
                )
            ]
            if self.spec_verifies
            else []
        )


def _pct(values: Sequence[float], q: float) -> float:
    return float(np.percentile(np.asarray(values, dtype=np.float64), q)) if len(values) else 0.0


class MetricsCollector:
    """Accumulates per-step samples and finished requests; :meth:`snapshot` summarises."""

    def __init__(self, usable_blocks: int) -> None:
        self.usable_blocks = usable_blocks
        self.reset()

    def reset(self) -> None:
        """Forget everything (start of a new run)."""
        self.start: float | None = None
        self.end: float | None = None
        self.steps = 0
        self.util: list[float] = []
        self.used: list[int] = []
        self.outputs: list[RequestOutput] = []
        self.spec_verifies = 0
        self.spec_draft_tokens = 0
        self.spec_accepted_tokens = 0
        self.prefill_tokens = 0

    def on_verify(self, num_drafts: int, num_accepted: int) -> None:
        """Record one sequence's verify step: ``num_drafts`` proposed, ``num_accepted`` kept."""
        self.spec_verifies += 1
        self.spec_draft_tokens += num_drafts
        self.spec_accepted_tokens += num_accepted

    def on_step(self, stats: Any, prefill_tokens: int = 0) -> None:
        """Record one step's cache stats (a :class:`pagedkv.CacheStats`) and the prefill tokens
        it computes (:attr:`ScheduledBatch.num_prefill_tokens
        <pagedkv.engine.scheduler.ScheduledBatch.num_prefill_tokens>`)."""
        if self.start is None:
            self.start = time.perf_counter()
        self.steps += 1
        self.prefill_tokens += prefill_tokens
        self.util.append(float(stats.kv_utilization))
        self.used.append(int(stats.used))

    def on_finished(self, out: RequestOutput) -> None:
        """Record a finished request."""
        self.outputs.append(out)
        self.end = out.finish_time

    def snapshot(self, stats: Any, slo: ServiceLevelObjective = DEFAULT_SLO) -> EngineMetrics:
        """Summary so far; ``stats`` is the manager's current :class:`pagedkv.CacheStats`
        (cumulative counters: prefix hits, copies, swaps, preemptions); goodput is judged
        against ``slo``.

        Raises:
            EngineConfigError: ``slo`` is not a :class:`ServiceLevelObjective`.
        """
        if not isinstance(slo, ServiceLevelObjective):
            raise EngineConfigError(
                f"slo={slo!r} is invalid: expected a ServiceLevelObjective(ttft_s=..., tpot_s=...)"[:200]
            )
        outs = self.outputs
        elapsed = (self.end - self.start) if (self.start is not None and self.end is not None) else 0.0
        n_tok = sum(len(c.token_ids) for o in outs for c in o.outputs)
        ttft = [o.ttft_s for o in outs]
        tpot_or_none = [o.tpot_s for o in outs]
        tpot = [t for t in tpot_or_none if t is not None]
        good = goodput(ttft, tpot_or_none, slo, elapsed)
        per_s = (lambda x: x / elapsed) if elapsed > 0 else (lambda x: 0.0)
        return EngineMetrics(
            num_requests=len(outs),
            num_output_tokens=n_tok,
            elapsed_s=elapsed,
            requests_per_s=per_s(len(outs)),
            output_tokens_per_s=per_s(n_tok),
            ttft_p50_s=_pct(ttft, 50),
            ttft_p99_s=_pct(ttft, 99),
            tpot_p50_s=_pct(tpot, 50),
            tpot_p99_s=_pct(tpot, 99),
            slo_ttft_s=slo.ttft_s,
            slo_tpot_s=slo.tpot_s,
            good_requests=good.good_requests,
            goodput_share=good.share,
            goodput_requests_per_s=good.requests_per_s,
            kv_utilization=float(np.mean(self.util)) if self.util else 0.0,
            mean_blocks_used=float(np.mean(self.used)) if self.used else 0.0,
            peak_blocks_used=max(self.used) if self.used else 0,
            usable_blocks=self.usable_blocks,
            prefix_hit_rate=float(stats.prefix_hit_rate),
            prefix_hit_tokens=int(stats.prefix_hits_tokens),
            copies=int(stats.copies),
            swapped_out_blocks=int(stats.swaps_out_blocks),
            swapped_in_blocks=int(stats.swaps_in_blocks),
            preemptions=int(stats.preemptions),
            num_steps=self.steps,
            spec_verifies=self.spec_verifies,
            spec_draft_tokens=self.spec_draft_tokens,
            spec_accepted_tokens=self.spec_accepted_tokens,
            spec_acceptance_rate=self.spec_accepted_tokens / self.spec_draft_tokens if self.spec_draft_tokens else 0.0,
            spec_tokens_per_verify=1 + self.spec_accepted_tokens / self.spec_verifies if self.spec_verifies else 0.0,
            prefill_tokens=self.prefill_tokens,
            # The host tier's counters exist only where the core has the tier.
            host_hit_tokens=int(getattr(stats, "host_hits_tokens", 0)),
            host_stored_blocks=int(getattr(stats, "host_stores_blocks", 0)),
            host_loaded_blocks=int(getattr(stats, "host_loads_blocks", 0)),
            host_blocks=int(getattr(stats, "num_host_blocks", 0)),
        )
