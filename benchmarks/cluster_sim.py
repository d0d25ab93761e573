"""Cluster routing simulation on the Mooncake conversation trace (Qin et al., FAST'25): prefix hit
rate, time to first token and load balance of KV-aware routing against round-robin and
least-loaded routing, beside one cache as large as all replicas together.

No model runs. Each replica is a ``pagedkv.KVCacheManager`` (events on) with a step-based time
model of a continuous-batching engine: every step decodes one token for each running request
and prefills up to ``--step-tokens`` uncached prompt tokens (chunked prefill, FCFS), and lasts

    step_s = --step-base-ms + --prefill-us-per-token * prefill tokens + --decode-us-per-seq * decodes

so prefill cost is proportional to the uncached prompt tokens and decode cost is per step. A
request is admitted when its prompt blocks (after prefix hits) plus its output blocks fit in the
pool; its time to first token (TTFT) is the end of the step that finishes its prefill minus its
arrival. After every step the replica's KV events go, as one numbered batch, to a
``pagedkv.KVIndexer``; the router (``pagedkv.routing.Router``) sees the index, the predicted
blocks of requests routed but not yet admitted, and every replica's load (running + waiting
requests, KV blocks used) at each arrival.

Prompts: each Mooncake ``hash_ids`` entry (a 512-token block) expands to deterministic token ids
(:func:`common.expand_hash_ids`), so requests sharing hash ids share real token prefixes that
pagedkv re-derives by hashing its own blocks. Arrival times are the trace's, divided by
``--speedup`` (default: chosen per replica count so the cluster is busy; see ``--rate-per-replica``).

"one big cache" is a single replica with all replicas' blocks (same time model, N times
faster): its hit rate bounds what routing over N separate caches can reach.

Load balance: at every arrival, max over replicas / mean over replicas of running + waiting
requests; the table gives the average of that ratio over arrivals (when the mean is > 0).

Usage: ``python benchmarks/cluster_sim.py [--replicas 8 16] [--traces-dir DIR]`` (DIR holding the full
Mooncake trace as ``mooncake_fast25/conversation_trace.jsonl``; the default is the excerpt in benchmarks/data)
"""

from __future__ import annotations

import argparse
import heapq
import sys
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402

import pagedkv  # noqa: E402
from pagedkv.routing import Router, WorkerLoad, policy_by_name  # noqa: E402

POLICIES = ["kv_aware", "round_robin", "least_loaded"]


@dataclass
class TimeModel:
    """Step time of one replica: ``base + prefill * tokens + decode * sequences`` (seconds)."""

    base_s: float
    prefill_s_per_token: float
    decode_s_per_seq: float
    step_tokens: int

    def scaled(self, factor: float) -> TimeModel:
        """The same engine ``factor`` times faster (and ``factor`` times the token budget)."""
        return TimeModel(
            self.base_s / factor,
            self.prefill_s_per_token / factor,
            self.decode_s_per_seq / factor,
            int(self.step_tokens * factor),
        )


@dataclass
class Request:
    idx: int
    arrival: float
    tokens: np.ndarray
    output_len: int
    prefill_left: int = 0
    decode_left: int = 0
    ttft: float | None = None
    cached_tokens: int = 0


@dataclass
class Replica:
    """One simulated engine: a pagedkv manager, FCFS waiting queue, running set, clock."""

    rid: int
    manager: pagedkv.KVCacheManager
    block_size: int
    tm: TimeModel
    waiting: deque[Request] = field(default_factory=deque)
    prefilling: list[Request] = field(default_factory=list)
    decoding: list[Request] = field(default_factory=list)
    reserved_blocks: int = 0
    admitted: list[Request] = field(default_factory=list)  # since the last step ended
    busy: bool = False
    seq: int = 0

    @property
    def num_requests(self) -> int:
        return len(self.waiting) + len(self.prefilling) + len(self.decoding)

    def load(self) -> WorkerLoad:
        st = self.manager.stats()
        return WorkerLoad(
            num_running=len(self.prefilling) + len(self.decoding),
            num_waiting=len(self.waiting),
            kv_blocks_used=int(st.used),
            kv_blocks_total=int(st.num_blocks) - 1,
            num_prefill_tokens=sum(r.prefill_left for r in self.prefilling) + sum(len(r.tokens) for r in self.waiting),
        )

    def _admit(self) -> None:
        """FCFS admission while the prompt (after prefix hits) and output blocks fit."""
        m, bs = self.manager, self.block_size
        while self.waiting:
            r = self.waiting[0]
            m.add_sequence(r.idx, r.tokens)
            need = m.num_blocks_needed(r.idx, len(r.tokens))[0] + (r.output_len + bs - 1) // bs + 1
            if need > m.pool.num_free - self.reserved_blocks:
                m.free(r.idx)
                return
            alloc = m.allocate_slots(r.idx, len(r.tokens))
            self.waiting.popleft()
            r.cached_tokens = alloc.num_cached_tokens
            r.prefill_left = alloc.num_scheduled_tokens
            r.decode_left = r.output_len
            self.reserved_blocks += (r.output_len + bs - 1) // bs + 1
            r.reserve = (r.output_len + bs - 1) // bs + 1  # type: ignore[attr-defined]
            self.prefilling.append(r)
            self.admitted.append(r)

    def step(self, now: float) -> tuple[float, list[Request]]:
        """Runs one step starting at ``now``; returns its end time and finished requests."""
        self._admit()
        m = self.manager
        budget = self.tm.step_tokens
        n_decode = len(self.decoding)
        prefill_tokens = 0
        done_prefill: list[Request] = []
        for r in self.prefilling:
            if budget == 0:
                break
            t = min(budget, r.prefill_left)
            r.prefill_left -= t
            budget -= t
            prefill_tokens += t
            if r.prefill_left == 0:
                done_prefill.append(r)
        end = now + self.tm.base_s + self.tm.prefill_s_per_token * prefill_tokens
        end += self.tm.decode_s_per_seq * n_decode
        finished: list[Request] = []
        still: list[Request] = []
        for r in self.decoding:
            r.decode_left -= 1
            (finished if r.decode_left <= 0 else still).append(r)
        for r in done_prefill:
            self.prefilling.remove(r)
            r.ttft = end - r.arrival
            # The first output token comes with the prefill; the rest are decode steps. Output
            # blocks are taken now, out of this request's reservation.
            out = common.unique_tokens(r.idx, r.output_len)
            m.append_tokens(r.idx, out)
            m.allocate_slots(r.idx, r.output_len)
            self.reserved_blocks -= r.reserve  # type: ignore[attr-defined]
            r.decode_left = r.output_len - 1
            (finished if r.decode_left <= 0 else still).append(r)
        self.decoding = still
        for r in finished:
            m.free(r.idx)
        return end, finished


def expand_prompts(w: common.Workload) -> list[np.ndarray]:
    assert w.hash_ids is not None
    return [common.expand_hash_ids(h, int(p)) for h, p in zip(w.hash_ids, w.prompt_lens.tolist())]


def simulate(
    output_lens: np.ndarray,
    prompts: list[np.ndarray],
    arrivals: np.ndarray,
    n_replicas: int,
    policy: str | None,
    blocks_per_replica: int,
    block_size: int,
    tm: TimeModel,
    hash_algo: str,
    weights: dict[str, float | None] | None = None,
    parents: np.ndarray | None = None,
) -> dict[str, Any]:
    """Replays the requests (``prompts[i]`` token ids, ``output_lens[i]`` tokens out, arriving at
    ``arrivals[i]`` seconds) on ``n_replicas`` replicas routed by ``policy`` (None: one replica,
    for the single-cache bound; ``weights`` go to :class:`KVAwarePolicy`). ``parents[i]``: the
    request whose prompt and reply request ``i``'s prompt continues (a conversation's previous
    turn; -1: none): request ``i`` then arrives at ``arrivals[i]`` or when its parent finishes,
    whichever is later (a user sends the next turn after reading the reply). Returns hit rate,
    TTFT percentiles, load balance (mean over arrivals of max / mean running + waiting) and the
    mean requests in flight per replica."""
    cfg = pagedkv.CacheConfig(blocks_per_replica, block_size, hash_algo=hash_algo, enable_events=True)
    replicas = [Replica(i, pagedkv.KVCacheManager(cfg), block_size, tm) for i in range(n_replicas)]
    router = None
    if policy is not None:
        router = Router(pagedkv.KVIndexer(block_size, hash_algo=hash_algo), policy_by_name(policy, **(weights or {})))
        for rep in replicas:
            router.add_worker(rep.rid)
    reqs = [Request(i, float(arrivals[i]), prompts[i], int(output_lens[i])) for i in range(len(prompts))]
    heap: list[tuple[float, int, int]] = []  # (time, kind 0=step end 1=arrival, id)
    children: dict[int, list[int]] = {}
    for r in reqs:
        parent = -1 if parents is None else int(parents[r.idx])
        if parent >= 0:
            children.setdefault(parent, []).append(r.idx)
        else:
            heapq.heappush(heap, (r.arrival, 1, r.idx))
    imbalance: list[float] = []
    in_flight: list[float] = []
    t_wall = time.perf_counter()
    route_s = 0.0
    while heap:
        now, kind, i = heapq.heappop(heap)
        if kind == 1:
            r = reqs[i]
            if router is None:
                rep = replicas[0]
            else:
                for x in replicas:
                    router.report_load(x.rid, x.load())
                q = np.array([x.num_requests for x in replicas], dtype=np.float64)
                in_flight.append(float(q.mean()))
                if q.mean() > 0:
                    imbalance.append(float(q.max() / q.mean()))
                t0 = time.perf_counter()
                rep = replicas[router.route(r.tokens, request_id=str(r.idx)).worker]
                route_s += time.perf_counter() - t0
            rep.waiting.append(r)
        else:
            rep = replicas[i]
            rep.busy = False
        if not rep.busy and rep.num_requests > 0:
            end, finished = rep.step(now)
            for f in finished:  # the next turns of finished requests may now arrive
                for c in children.pop(f.idx, []):
                    reqs[c].arrival = max(reqs[c].arrival, end)
                    heapq.heappush(heap, (reqs[c].arrival, 1, c))
            if router is not None:
                events = rep.manager.take_events()
                if events:
                    router.apply_events(rep.rid, rep.seq, events)
                    rep.seq += 1
                # Admitted requests' blocks are now in the index: stop predicting them.
                for a in rep.admitted:
                    router.finished(str(a.idx))
            rep.admitted.clear()
            rep.busy = True
            heapq.heappush(heap, (end, 0, rep.rid))
    ttft = np.array([r.ttft for r in reqs], dtype=np.float64)
    prompt_tokens = sum(len(p) for p in prompts)
    # Hits from the admissions themselves (manager counters also count re-admission attempts).
    hits = sum(r.cached_tokens for r in reqs)
    return {
        "policy": policy or "one_big_cache",
        "replicas": n_replicas,
        "hit_rate": hits / prompt_tokens,
        "ttft_p50_s": float(np.percentile(ttft, 50)),
        "ttft_p99_s": float(np.percentile(ttft, 99)),
        "ttft_mean_s": float(ttft.mean()),
        "load_max_over_mean": float(np.mean(imbalance)) if imbalance else None,
        "in_flight_per_replica": float(np.mean(in_flight)) if in_flight else None,
        "route_us_per_request": 1e6 * route_s / len(reqs) if router is not None else None,
        "sim_wall_s": time.perf_counter() - t_wall,
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--traces-dir", default=None, help="folder with the full traces (default: bundled excerpt)")
    ap.add_argument("--requests", type=int, default=None, help="first N requests of the trace")
    ap.add_argument("--replicas", nargs="+", type=int, default=[8, 16])
    ap.add_argument("--block-size", type=int, default=32)
    ap.add_argument("--kv-tokens-per-replica", type=int, default=1 << 20, help="KV capacity of one replica, tokens")
    ap.add_argument("--step-base-ms", type=float, default=15.0)
    ap.add_argument("--prefill-us-per-token", type=float, default=40.0)
    ap.add_argument("--decode-us-per-seq", type=float, default=150.0)
    ap.add_argument("--step-tokens", type=int, default=4096, help="prefill token budget per step")
    ap.add_argument(
        "--rate-per-replica",
        type=float,
        default=1.0,
        help="mean arrivals per second per replica; the trace's timestamps are scaled to it",
    )
    ap.add_argument("--policies", nargs="+", default=POLICIES, choices=POLICIES)
    ap.add_argument("--no-bound", action="store_true", help="skip the one-big-cache run")
    ap.add_argument(
        "--overlap-weight",
        type=float,
        default=None,
        help="kv_aware: weight of the uncached share (default: KVAwarePolicy's)",
    )
    ap.add_argument("--load-weight", type=float, default=None, help="kv_aware: weight of the relative load")
    ap.add_argument("--prefill-weight", type=float, default=None, help="kv_aware: weight of queued prefill tokens")
    ap.add_argument("--hash-algo", default="xxh3_128", choices=["sha256", "xxh3_128"])
    ap.add_argument("--results-dir", default=str(common.RESULTS_DIR))
    args = ap.parse_args(argv)

    w = common.load_workload("mooncake", args.traces_dir, n=args.requests)
    prompts = expand_prompts(w)
    span = float(w.arrival_s[-1] - w.arrival_s[0]) or 1.0
    tm = TimeModel(
        args.step_base_ms / 1e3, args.prefill_us_per_token / 1e6, args.decode_us_per_seq / 1e6, args.step_tokens
    )
    blocks = args.kv_tokens_per_replica // args.block_size + 1
    rows: list[dict[str, Any]] = []
    for n in args.replicas:
        # Scale the trace's timestamps to the target rate (relative spacing kept).
        speedup = args.rate_per_replica * n * span / len(w)
        arrivals = (w.arrival_s - w.arrival_s[0]) / speedup
        for pol in args.policies:
            weights = {
                k: getattr(args, k)
                for k in ("overlap_weight", "load_weight", "prefill_weight")
                if getattr(args, k) is not None
            }
            res = simulate(
                w.output_lens,
                prompts,
                arrivals,
                n,
                pol,
                blocks,
                args.block_size,
                tm,
                args.hash_algo,
                weights if pol == "kv_aware" else {},
            )
            res["speedup"] = speedup
            rows.append(res)
            print(f"{n} replicas {pol}: {res}", file=sys.stderr)
        if args.no_bound:
            continue
        big = simulate(
            w.output_lens,
            prompts,
            arrivals,
            1,
            None,
            (blocks - 1) * n + 1,
            args.block_size,
            tm.scaled(n),
            args.hash_algo,
        )
        big["replicas"] = n
        big["speedup"] = speedup
        rows.append(big)
        print(f"{n} replicas one big cache: {big}", file=sys.stderr)

    cols = [
        "replicas",
        "policy",
        "hit rate",
        "vs one big cache",
        "TTFT p50 s",
        "TTFT p99 s",
        "max/mean load",
        "route us/req",
    ]
    table = []
    for r in rows:
        bound = next(b for b in rows if b["replicas"] == r["replicas"] and b["policy"] == "one_big_cache")
        table.append(
            [
                r["replicas"],
                r["policy"],
                f"{100 * r['hit_rate']:.1f}%",
                f"{100 * r['hit_rate'] / bound['hit_rate']:.1f}%",
                r["ttft_p50_s"],
                r["ttft_p99_s"],
                r["load_max_over_mean"],
                r["route_us_per_request"],
            ]
        )
    common.print_table(f"Cluster routing on Mooncake ({len(w)} requests)", cols, table)
    payload = {
        "workload": w.describe(),
        "params": vars(args),
        "rows": rows,
        "markdown": common.markdown_table(cols, table),
    }
    results_dir = Path(args.results_dir)
    common.write_json("cluster_sim", payload, results_dir)
    plot(rows, results_dir / "cluster_sim.png")
    return payload


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    """Hit rate, TTFT p99 and load balance per policy, one group per replica count."""
    plt = common.pyplot()
    ns = sorted({r["replicas"] for r in rows})
    pols = POLICIES + ["one_big_cache"]
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    metrics = [
        ("hit_rate", "prefix hit rate"),
        ("ttft_p99_s", "TTFT p99 (s)"),
        ("load_max_over_mean", "max/mean running+waiting"),
    ]
    width = 0.8 / len(pols)
    for ax, (key, label) in zip(axes, metrics):
        for j, pol in enumerate(pols):
            vals = []
            for n in ns:
                r = next(x for x in rows if x["replicas"] == n and x["policy"] == pol)
                vals.append(r[key] if r[key] is not None else 0.0)
            ax.bar(np.arange(len(ns)) + j * width, vals, width, label=pol)
        ax.set_xticks(np.arange(len(ns)) + width * (len(pols) - 1) / 2)
        ax.set_xticklabels([f"{n} replicas" for n in ns])
        ax.set_title(label)
    axes[0].legend(fontsize=8)
    fig.suptitle("KV-aware routing vs baselines, Mooncake conversation trace (simulated)")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
