"""Goodput (:mod:`pagedkv.engine.goodput`) and the engine metrics built on it, on hand-computed
per-request times: TTFT, TPOT, the one-token rule, inclusive targets, share and rate."""

from __future__ import annotations

import math

import numpy as np
import pytest

import pagedkv
from pagedkv.engine import EngineConfigError, ServiceLevelObjective
from pagedkv.engine.goodput import DEFAULT_SLO, goodput, time_per_output_token
from pagedkv.engine.metrics import MetricsCollector
from pagedkv.engine.request import CompletionOutput, RequestOutput


def _out(rid: str, arrival: float, first: float, finish: float, n_tokens: int) -> RequestOutput:
    completion = CompletionOutput(index=0, text="", token_ids=tuple(range(n_tokens)), finish_reason="length")
    return RequestOutput(
        request_id=rid,
        prompt=None,
        prompt_token_ids=(1, 2),
        outputs=(completion,),
        num_cached_tokens=0,
        num_preemptions=0,
        arrival_time=arrival,
        first_token_time=first,
        finish_time=finish,
    )


# (id, arrival, first token, finish, output tokens) -> TTFT, TPOT by hand, against TTFT <= 1 s and
# TPOT <= 0.1 s:
#   a: TTFT 0.5, TPOT (1.5 - 0.5) / 10 = 0.1  -> good (both targets are inclusive)
#   d: TTFT 0.5, one token, no TPOT           -> good (judged on TTFT alone)
#   b: TTFT 1.2, TPOT (2.0 - 1.2) / 4 = 0.2   -> misses both
#   c: TTFT 0.25, TPOT (2.75 - 0.75) / 4 = 0.5 -> misses TPOT
#   e: TTFT 3.0, one token                    -> misses TTFT
# Finish order a, d, b, c, e; the window runs from the first step (t = 0) to e's finish (t = 4).
REQUESTS = [
    ("a", 0.0, 0.5, 1.5, 11),
    ("d", 1.0, 1.5, 1.5, 1),
    ("b", 0.0, 1.2, 2.0, 5),
    ("c", 0.5, 0.75, 2.75, 5),
    ("e", 1.0, 4.0, 4.0, 1),
]
SLO = ServiceLevelObjective(ttft_s=1.0, tpot_s=0.1)


def test_time_per_output_token_by_hand() -> None:
    assert time_per_output_token(0.5, 1.5, 11) == pytest.approx(0.1, abs=1e-15)
    assert time_per_output_token(2.0, 5.0, 4) == 1.0
    assert time_per_output_token(1.5, 1.5, 1) is None
    assert time_per_output_token(1.5, 1.5, 0) is None


def test_goodput_share_and_rate_by_hand() -> None:
    ttft = [first - arrival for _, arrival, first, _, _ in REQUESTS]
    tpot = [time_per_output_token(first, finish, n) for _, _, first, finish, n in REQUESTS]
    g = goodput(ttft, tpot, SLO, elapsed_s=4.0)
    assert (g.good_requests, g.num_requests) == (2, 5)
    assert g.share == 0.4 and g.requests_per_s == 0.5
    # Each target on its own decides: a looser TPOT target lets c in, a looser TTFT target b too.
    assert goodput(ttft, tpot, ServiceLevelObjective(1.0, 0.5), 4.0).good_requests == 3
    assert goodput(ttft, tpot, ServiceLevelObjective(1.2, 0.5), 4.0).good_requests == 4
    assert goodput(ttft, tpot, ServiceLevelObjective(3.0, 0.5), 4.0).good_requests == 5


def test_goodput_edges() -> None:
    assert goodput([], [], SLO, 0.0) == goodput([], [], SLO, 5.0)
    assert goodput([], [], SLO, 5.0).share == 0.0 and goodput([], [], SLO, 5.0).requests_per_s == 0.0
    assert goodput([0.1], [None], SLO, 0.0).requests_per_s == 0.0  # zero-length window: no rate
    assert goodput([1.0], [0.1], SLO, 1.0).good_requests == 1  # exactly on both targets
    assert goodput([1.0 + 1e-9], [0.1], SLO, 1.0).good_requests == 0
    with pytest.raises(ValueError, match="2 TTFT values but 1 TPOT values"):
        goodput([0.1, 0.2], [None], SLO, 1.0)


def test_metrics_snapshot_reports_goodput_by_hand() -> None:
    manager = pagedkv.KVCacheManager(pagedkv.CacheConfig(num_blocks=8, block_size=4))
    collector = MetricsCollector(usable_blocks=7)
    collector.on_step(manager.stats())
    collector.start = 0.0  # the first step's time, on the same clock as the hand-made times
    for rid, arrival, first, finish, n in REQUESTS:
        collector.on_finished(_out(rid, arrival, first, finish, n))
    m = collector.snapshot(manager.stats(), SLO)
    assert (m.num_requests, m.elapsed_s, m.requests_per_s) == (5, 4.0, 1.25)
    assert (m.slo_ttft_s, m.slo_tpot_s) == (1.0, 0.1)
    assert (m.good_requests, m.goodput_share, m.goodput_requests_per_s) == (2, 0.4, 0.5)
    # TTFT over all five (0.5, 0.5, 1.2, 0.25, 3.0), TPOT over the three with >= 2 tokens.
    assert m.ttft_p50_s == 0.5 and m.tpot_p50_s == pytest.approx(0.2)
    rows = dict(m.table_rows())
    assert rows["SLO targets"] == "TTFT <= 1 s, TPOT <= 0.1 s"
    assert rows["goodput (both SLOs met)"] == "40.0% (2/5 requests), 0.50 requests/s"
    d = m.as_dict()
    assert (d["good_requests"], d["goodput_share"], d["goodput_requests_per_s"]) == (2, 0.4, 0.5)
    # The default objective (TTFT <= 2 s, TPOT <= 0.1 s): a and d meet it; b (TPOT 0.2 s),
    # c (TPOT 0.5 s) and e (TTFT 3 s) miss it.
    assert collector.snapshot(manager.stats()).good_requests == 2
    assert (DEFAULT_SLO.ttft_s, DEFAULT_SLO.tpot_s) == (2.0, 0.1)
    for bad in (2.0, (2.0, 0.1), "fast", None):
        with pytest.raises(EngineConfigError, match="expected a ServiceLevelObjective"):
            collector.snapshot(manager.stats(), bad)  # type: ignore[arg-type]
    assert collector.snapshot(manager.stats(), SLO).good_requests == 2  # nothing changed


def test_result_row_carries_tpot() -> None:
    row = _out("c", 0.5, 0.75, 2.75, 5).to_dict()
    assert (row["ttft_s"], row["tpot_s"], row["latency_s"]) == (0.25, 0.5, 2.25)
    assert _out("d", 1.0, 1.5, 1.5, 1).to_dict()["tpot_s"] is None


@pytest.mark.parametrize("field", ["ttft_s", "tpot_s"])
@pytest.mark.parametrize(
    "value",
    [0, 0.0, -1.0, math.nan, math.inf, -math.inf, True, np.bool_(True), "1", None, 10**400, np.float32("nan")],
    ids=lambda v: repr(v)[:16],
)
def test_bad_objective_is_a_typed_error_naming_the_field(field: str, value: object) -> None:
    with pytest.raises(EngineConfigError, match=rf"ServiceLevelObjective {field}=.* must be a finite number"):
        ServiceLevelObjective(**{field: value})  # type: ignore[arg-type]
    with pytest.raises(ValueError):  # EngineConfigError is a ValueError
        ServiceLevelObjective(**{field: value})  # type: ignore[arg-type]


def test_objective_takes_any_real_number_as_float_seconds() -> None:
    slo = ServiceLevelObjective(ttft_s=np.float32(0.5), tpot_s=np.int64(2))
    assert (slo.ttft_s, slo.tpot_s) == (0.5, 2.0)
    assert type(slo.ttft_s) is float and type(slo.tpot_s) is float
    assert ServiceLevelObjective(ttft_s=3).ttft_s == 3.0 and ServiceLevelObjective(tpot_s=1e300).tpot_s == 1e300
