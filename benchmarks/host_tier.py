"""The prefix cache's host tier: hit rate and recomputed tokens against host tier size, and the
CPU cost per block op of a tiered lookup against vLLM's CPU offloading manager.

Part 1, the sweep (no model: pagedkv's core manager alone). Each workload is replayed through
``pagedkv.KVCacheManager`` with a device pool too small for its working set, once per host tier
size (0 = no tier). Workloads:

- ``mooncake``: the Mooncake conversation trace (Qin et al., FAST'25): ``hash_ids`` expanded to
  deterministic tokens (:func:`common.expand_hash_ids`), so shared ids are shared prefixes;
- ``azure_conv``: the Azure LLM inference trace, conversation (Patel et al., ISCA'24). It holds
  lengths only, so every prompt is unique (:func:`common.unique_tokens`): no hit is possible, and
  the rows show what the tier costs on traffic that never comes back (with admission at
  ``min_seen=2`` nothing is stored; ``--min-seen 1`` stores every evicted block);
- ``chat``: a synthetic multi-turn chat (:func:`chat_workload`): conversations of 4-8 turns
  over 16 shared system prompts, each turn's prompt the system prompt plus every earlier turn
  (user message and the model's answer, whose KV was computed while decoding), 64
  conversations open at a time, a conversation's next turn sent only after its answer.

The replay (the scheduler of ``prefix_caching.py``): FCFS admission while the batch has room
(``--max-running``) and the device pool has the blocks the request needs after prefix hits
(``num_blocks_needed``: host hits need device blocks to load into); one decode token per running
request per step, output tokens unique per request (so they are hashed and cached like
generated text); recompute preemption of the newest request when a decode step lacks blocks.
The host tier's copy plans (``StepOutput.host_stores`` / ``host_loads``) are counted, not run.

Eviction (``--eviction lru arc``, both by default): LRU against ARC (Megiddo and Modha, FAST'03;
``CacheConfig(host_eviction="arc")``). Measured with ``python benchmarks/host_tier.py --min-seen 1 2
--eviction lru arc`` (results/host_tier.json, the plot's third row: ARC's hit rate minus LRU's),
ARC pays only where the host tier is well below the working set: chat with ``min_seen=1`` at 2,048
and 4,096 host blocks, hit rate 36.7 / 61.4 % against LRU's 33.8 / 59.8 % (recomputed tokens -5.2 /
-5.0 %), Mooncake with ``min_seen=1`` at 65,536 and 524,288 blocks (-2.5 / -6.5 % recomputed). It
loses near the working set (chat at 8,192 and 16,384 blocks: 88.6 / 89.8 % against 89.7 / 90.7 %;
with ``min_seen=2`` at 4,096-16,384 blocks: 1.1-1.4 points lower, 58.9 against 60.3 % at 4,096), and at
262,144 Mooncake blocks (+4.8 % recomputed), likely because a finished conversation's history, loaded once and
so in ARC's T2, outlives the open conversations' newest turns in T1. Mooncake with ``min_seen=2`` and
azure_conv (no hits possible) are identical under both. So the default stays LRU; ARC is kept for
host tiers much smaller than the reuse set.

Figures per run: hit rate (prefix-hit tokens, either tier, at each request's first admission /
prompt tokens), prefill tokens computed (every (re)admission's scheduled prompt tokens,
re-prefills after preemption included), recomputed tokens (prefill tokens computed beyond what an
unbounded cache that saw everything earlier would compute, :func:`ideal_hits`), the host tier's
hit tokens, blocks stored and loaded (from the manager's stats), evictions, preemptions, and the
manager's CPU time (``time.thread_time_ns`` around its calls). Host hit tokens are counted at a
request's first admission only (they are part of the hit rate), loaded blocks at every load: on
azure_conv every load is a resume after a recompute preemption (0 host hit tokens, 11,720 blocks
loaded at 65,536 host blocks, ``min_seen=1``).

Part 2, CPU cost per block op (``--no-ops`` skips it). The same block hashes (``--op-requests``
requests of ``--op-blocks`` full blocks of tokens unique to each, hashed by pagedkv's
``KVIndexer.block_hashes``, SHA-256, the manager's own hashes) drive both sides:

- pagedkv (this process): a manager with ``op-blocks + 2`` device blocks and a host tier holding
  every block, admission ``min_seen=1``. *store*: each request is allocated and freed in turn,
  so each allocation evicts the previous request's cached blocks into the host tier; timed: the
  loop's manager calls (``step``, ``free``), minus the same loop on a manager without host
  tier, divided by the host stores planned. *lookup*: each request is added again under a new id
  and ``lookup_prefix`` is called on all of them twice (every block a host hit); the first pass
  hashes each prompt's blocks (reported as ``hash_and_lookup``; vLLM's engine core hashes
  before its scheduler runs, so its side has no hashing), timed: the second pass / blocks
  found; ``device_lookup`` is the same second pass on a device pool that holds every block
  (no host tier), for comparison. *load*: each such request's first ``step`` allocation (``op-blocks + 1`` device
  blocks, the host hits planned as loads, the evicted device blocks stored when admissible)
  and its ``free``; timed / blocks loaded; it includes the device allocation, which vLLM's
  side does not have.
- vLLM (``--vllm-python``, default ``target/vllm-venv/bin/python`` when present, in a
  subprocess; :mod:`host_tier_vllm`): ``vllm.v1.kv_offload.cpu.manager.CPUOffloadingManager``
  (LRU, no store threshold) of as many chunks, one block per chunk, keys
  ``make_offload_key(hash, 0)``, one ``ReqContext`` per request (``on_new_request`` and
  ``on_request_finished`` untimed). *store*: ``prepare_store(keys)`` + ``complete_store(keys)``
  per request; *lookup*: ``lookup(key)`` per key until the first non-HIT, as the offloading
  connector's scheduler asks; *load*: ``prepare_load(keys)`` + ``touch(keys)`` +
  ``complete_load(keys)``. vLLM's device allocation for the loaded blocks is its
  ``KVCacheManager``'s and is not counted.

Each timing is the best of ``--op-repeats`` runs. ns per block op = CPU time / blocks.

Usage: ``python benchmarks/host_tier.py [--quick] [--traces-dir DIR] [--trace FILE]
[--eviction lru arc] [--min-seen 1 2] [--vllm-python PY] [--no-ops] [--out JSON]``; writes
``results/host_tier.json`` and ``results/host_tier.png`` (``--quick``: ``results/host_tier_quick.*``,
so a quick run never replaces the committed full results; ``--out`` names the JSON, the plot
goes beside it).
``--engine`` runs the reference engine instead (:func:`engine_main`, SmolLM2 on CPU): prefix-hit
tokens, prefill tokens, TTFT and goodput with and without a host tier, outputs compared.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402

BLOCK_SIZE = 16
MIB_TOKENS = 1 << 20
#: Device pool (tokens) and host tier sizes (tokens) of each workload's sweep.
SWEEPS: dict[str, tuple[int, list[int]]] = {
    "mooncake": (1 << 20, [0, 1 << 20, 1 << 21, 1 << 22, 1 << 23, 1 << 24, 1 << 25]),
    "azure_conv": (1 << 16, [0, 1 << 18, 1 << 20]),
    "chat": (1 << 15, [0, 1 << 14, 1 << 15, 1 << 16, 1 << 17, 1 << 18, 1 << 19]),
}
QUICK_SWEEPS: dict[str, tuple[int, list[int]]] = {
    "mooncake": (1 << 20, [0, 1 << 21, 1 << 23]),
    "azure_conv": (1 << 16, [0, 1 << 20]),
    "chat": (1 << 15, [0, 1 << 16, 1 << 18]),
}


# ----------------------------------------------------------------------------- workloads


@dataclass
class Stream:
    """Requests in arrival order, as token ids.

    Attributes:
        name: workload name.
        prompts: int64 token ids of each prompt.
        outputs: int64 token ids each request generates (its first one sampled by the prefill).
        after: index of the request that must finish before this one is admitted (the previous
            turn of its conversation), or -1.
        describe: summary for the result JSON.
    """

    name: str
    prompts: list[np.ndarray]
    outputs: list[np.ndarray]
    after: list[int]
    describe: dict[str, Any]

    def __len__(self) -> int:
        return len(self.prompts)


def trace_stream(w: common.Workload) -> Stream:
    """A trace's requests: Mooncake prompts from their hash ids, others unique per request;
    outputs unique per request."""
    prompts = [
        common.expand_hash_ids(w.hash_ids[r], int(w.prompt_lens[r]))
        if w.hash_ids is not None
        else common.unique_tokens(r, int(w.prompt_lens[r]))
        for r in range(len(w))
    ]
    outputs = [common.unique_tokens(r, int(w.output_lens[r]), salt=2) for r in range(len(w))]
    return Stream(w.name, prompts, outputs, [-1] * len(w), w.describe())


def chat_workload(
    conversations: int = 256,
    *,
    seed: int = 0,
    open_at_once: int = 64,
    system_prompts: int = 16,
    system_tokens: int = 256,
    user_mean: float = 120.0,
    answer_mean: float = 250.0,
    min_turns: int = 4,
    max_turns: int = 8,
) -> Stream:
    """A synthetic multi-turn chat (see the module docs): ``conversations`` conversations of
    ``min_turns..max_turns`` turns (uniform), each over one of ``system_prompts`` shared system
    prompts of ``system_tokens`` tokens; user messages and answers log-normal (sigma 1) with
    means ``user_mean`` / ``answer_mean`` tokens (clipped to 1..2000 / 1..1000). Turn ``t``'s
    prompt is the system prompt, then for each earlier turn its user message and answer, then
    its own user message. Arrival order: ``open_at_once`` conversations open, one turn each in
    turn; a finished conversation's place goes to the next one."""
    rng = np.random.default_rng(seed)
    systems = [common.unique_tokens(1_000_000 + i, system_tokens, salt=3) for i in range(system_prompts)]
    turns = rng.integers(min_turns, max_turns + 1, conversations)
    user = [common.lognormal_lengths(rng, int(n), user_mean, 1.0, 2000) for n in turns]
    answer = [common.lognormal_lengths(rng, int(n), answer_mean, 1.0, 1000) for n in turns]
    prompts: list[np.ndarray] = []
    outputs: list[np.ndarray] = []
    after: list[int] = []
    history = [systems[c % system_prompts] for c in range(conversations)]
    done_turns = [0] * conversations
    last = [-1] * conversations
    open_convs = deque(range(min(open_at_once, conversations)))
    next_conv = len(open_convs)
    while open_convs:
        c = open_convs.popleft()
        t = done_turns[c]
        msg = common.unique_tokens(c * 64 + t, int(user[c][t]), salt=4)
        ans = common.unique_tokens(c * 64 + t, int(answer[c][t]), salt=5)
        prompt = np.concatenate([history[c], msg])
        prompts.append(prompt)
        outputs.append(ans)
        after.append(last[c])
        last[c] = len(prompts) - 1
        history[c] = np.concatenate([prompt, ans])
        done_turns[c] += 1
        if done_turns[c] < turns[c]:
            open_convs.append(c)
        elif next_conv < conversations:
            open_convs.append(next_conv)
            next_conv += 1
    p = np.asarray([len(x) for x in prompts])
    o = np.asarray([len(x) for x in outputs])
    return Stream(
        "chat",
        prompts,
        outputs,
        after,
        {
            "name": "chat",
            "source": f"synthetic multi-turn chat, seed {seed}",
            "requests": len(prompts),
            "conversations": conversations,
            "open_at_once": open_at_once,
            "system_prompts": system_prompts,
            "system_tokens": system_tokens,
            "prompt_mean": float(p.mean()),
            "prompt_max": int(p.max()),
            "output_mean": float(o.mean()),
        },
    )


def mooncake_conversations(
    w: common.Workload, count: int, *, min_turns: int = 3, max_ids: int | None = None
) -> list[int]:
    """Indices (in trace order) of the requests of the trace's first ``count`` multi-turn
    conversations with at least ``min_turns`` requests: each request joins the conversation of
    the earlier request it shares its longest hash-id prefix with, when that prefix is at least
    2 ids (every request shares id 0, the system prompt); conversations whose longest request
    has more than ``max_ids`` ids are left out."""
    assert w.hash_ids is not None, "a trace with hash_ids"
    owner: dict[tuple[int, ...], int] = {}
    root = list(range(len(w)))
    for r, ids in enumerate(w.hash_ids):
        k = 0
        while k < len(ids) and tuple(ids[: k + 1]) in owner:
            k += 1
        if k >= 2:
            root[r] = root[owner[tuple(ids[:k])]]
        for j in range(1, len(ids) + 1):
            owner.setdefault(tuple(ids[:j]), r)
    convs: dict[int, list[int]] = {}
    for r in range(len(w)):
        convs.setdefault(root[r], []).append(r)
    chosen = [
        c
        for c in convs.values()
        if len(c) >= min_turns and (max_ids is None or max(len(w.hash_ids[r]) for r in c) <= max_ids)
    ]
    return sorted(r for c in sorted(chosen, key=lambda c: c[0])[:count] for r in c)


def ideal_hits(s: Stream, block_size: int) -> int:
    """Prompt tokens an unbounded prefix cache that never evicts serves: per request the longest
    run of leading full blocks (at most ``prompt - 1`` tokens) an earlier request computed
    (prompt and output; the last sampled token has no KV), chained like the prefix hash."""
    seen: set[int] = set()
    cached = 0
    for prompt, out in zip(s.prompts, s.outputs):
        toks = np.concatenate([prompt, out[:-1]])
        nfull = len(toks) // block_size
        blocks = toks[: nfull * block_size].reshape(nfull, block_size)
        keys = []
        k = 0
        for b in blocks:
            k = hash((k, b.tobytes()))
            keys.append(k)
        hit = 0
        limit = (len(prompt) - 1) // block_size
        while hit < limit and keys[hit] in seen:
            hit += 1
        cached += hit * block_size
        seen.update(keys)
    return cached


# ----------------------------------------------------------------------------- replay


def make_manager(device_blocks: int, host_blocks: int, *, min_seen: int = 2, eviction: str = "lru") -> Any:
    """A manager with ``device_blocks`` usable device blocks and a host tier of ``host_blocks``
    (0: none; then no host-tier argument reaches ``CacheConfig``)."""
    import pagedkv  # noqa: PLC0415

    host: dict[str, Any] = {}
    if host_blocks:
        host = {"num_host_blocks": host_blocks, "host_admission_min_seen": min_seen, "host_eviction": eviction}
    return pagedkv.KVCacheManager(pagedkv.CacheConfig(num_blocks=device_blocks + 1, block_size=BLOCK_SIZE, **host))


def replay(
    s: Stream,
    *,
    device_tokens: int,
    host_tokens: int,
    min_seen: int = 2,
    eviction: str = "lru",
    max_running: int = 64,
    ideal: int | None = None,
) -> dict[str, Any]:
    """Replay ``s`` through a manager (see the module docs); returns the run's figures."""
    bs = BLOCK_SIZE
    usable = device_tokens // bs
    mgr = make_manager(usable, host_tokens // bs, min_seen=min_seen, eviction=eviction)
    pool = mgr.pool
    plen = [len(x) for x in s.prompts]
    olen = [len(x) for x in s.outputs]
    longest = max(a + b for a, b in zip(plen, olen))
    if -(-longest // bs) > usable:
        raise ValueError(f"a device pool of {device_tokens} tokens cannot hold the longest request ({longest} tokens)")
    waiting: deque[int] = deque(range(len(s)))
    running: list[int] = []
    sampled: dict[int, int] = {}
    written: dict[int, int] = {}
    finished = np.zeros(len(s), dtype=bool)
    registered: set[int] = set()
    prefill = cached_first = preemptions = steps = stores = loads = 0
    cpu = 0
    tick = time.thread_time_ns
    t0 = time.perf_counter()
    while waiting or running:
        steps += 1
        free = pool.num_free
        need = sum(1 for r in running if written[r] % bs == 0)
        while need > free:
            victim = running.pop()
            c = tick()
            mgr.preempt([victim])
            cpu += tick() - c
            preemptions += 1
            need -= written[victim] % bs == 0
            free = pool.num_free
            written[victim] = 0
            waiting.appendleft(victim)
        free -= need
        ids, num_new, app = [], [], []
        for r in running:
            ids.append(r)
            num_new.append(1)
            app.append([int(s.outputs[r][sampled[r] - 1])])
        admitted = []
        while waiting and len(running) + len(admitted) < max_running:
            r = waiting[0]
            if s.after[r] >= 0 and not finished[s.after[r]]:
                break  # the conversation's previous answer is not there yet
            g = sampled.get(r, 0)
            c = tick()
            if r not in registered:
                mgr.add_sequence(r, s.prompts[r])
                registered.add(r)
            # A resumed request's last sampled token is appended by the step itself: +1 token.
            nb = mgr.num_blocks_needed(r, plen[r] + g)[0] + (1 if g and (plen[r] + g - 1) % bs == 0 else 0)
            cpu += tick() - c
            if nb > free:
                break
            free -= nb
            waiting.popleft()
            admitted.append(r)
            ids.append(r)
            num_new.append(plen[r] + g)
            app.append([int(s.outputs[r][g - 1])] if g else [])
        if not ids:
            raise RuntimeError(f"request {waiting[0]} can never fit in {usable} blocks")
        c = tick()
        out = mgr.step(ids, num_new, app)
        cpu += tick() - c
        if out.error is not None:
            raise RuntimeError(f"pagedkv step {steps} failed: {out.error!r}")
        if host_tokens:
            stores += len(out.host_stores)
            loads += len(out.host_loads)
        nrun = len(running)
        q = out.query_start_loc
        for r in running:
            written[r] += 1
            sampled[r] += 1
        for j, r in enumerate(admitted):
            i = nrun + j
            if r not in sampled:
                cached_first += int(out.num_cached_tokens[i])
            prefill += int(q[i + 1] - q[i])
            g = sampled.get(r, 0)
            written[r] = plen[r] + g
            sampled[r] = g + 1
        running.extend(admitted)
        done = [r for r in running if sampled[r] == olen[r]]
        if done:
            c = tick()
            for r in done:
                mgr.free(r)
            cpu += tick() - c
            for r in done:
                finished[r] = True
                del sampled[r], written[r]
            dset = set(done)
            running = [r for r in running if r not in dset]
    mgr.check_invariants()
    st = mgr.stats()
    prompt_tokens = sum(plen)
    res = {
        "device_tokens": device_tokens,
        "host_tokens": host_tokens,
        "min_seen": min_seen if host_tokens else None,
        "eviction": eviction if host_tokens else None,
        "prompt_tokens": prompt_tokens,
        "hit_tokens": cached_first,
        "hit_rate": cached_first / prompt_tokens,
        "prefill_tokens": prefill,
        "recomputed_tokens": None if ideal is None else prefill - (prompt_tokens - ideal),
        "host_hit_tokens": int(getattr(st, "host_hits_tokens", 0)),
        "host_stored_blocks": int(getattr(st, "host_stores_blocks", 0)),
        "host_loaded_blocks": int(getattr(st, "host_loads_blocks", 0)),
        "planned_stores": stores,
        "planned_loads": loads,
        "evictions": int(st.evictions),
        "preemptions": preemptions,
        "steps": steps,
        "manager_cpu_s": cpu / 1e9,
        "seconds": time.perf_counter() - t0,
    }
    return res


def sweep(
    s: Stream, device_tokens: int, host_sizes: Sequence[int], *, min_seen: Sequence[int], evictions: Sequence[str]
) -> dict[str, Any]:
    """Every host size of one workload (with each admission threshold and eviction policy)."""
    ideal = ideal_hits(s, BLOCK_SIZE)
    runs = []
    configs = [(0, min_seen[0], evictions[0])] + [
        (h, m, e) for h in host_sizes if h for m in min_seen for e in evictions
    ]
    bar = common.progress(total=len(configs), desc=f"host tier {s.name}")
    for h, m, e in configs:
        bar.set_postfix_str(f"host {h} tokens, min_seen {m}, {e}")
        runs.append(replay(s, device_tokens=device_tokens, host_tokens=h, min_seen=m, eviction=e, ideal=ideal))
        bar.update(1)
    bar.close()
    total = sum(len(p) for p in s.prompts)
    return {
        "workload": s.describe,
        "device_tokens": device_tokens,
        "ideal": {"prompt_tokens": total, "hit_tokens": ideal, "hit_rate": ideal / total},
        "runs": runs,
    }


# ----------------------------------------------------------------------------- CPU per block op


def op_stream(requests: int, blocks: int) -> list[np.ndarray]:
    """Token ids of ``requests`` requests of ``blocks`` full blocks plus one token, unique to
    each request (no shared prefix)."""
    return [common.unique_tokens(500_000 + r, blocks * BLOCK_SIZE + 1, salt=6) for r in range(requests)]


def op_hashes(prompts: list[np.ndarray], blocks: int) -> list[list[bytes]]:
    """pagedkv's block hashes (SHA-256, empty seed: a plain manager's) of each prompt."""
    import pagedkv  # noqa: PLC0415

    idx = pagedkv.KVIndexer(block_size=BLOCK_SIZE)
    return [idx.block_hashes(p, num_blocks=blocks) for p in prompts]


def pagedkv_ops(prompts: list[np.ndarray], blocks: int, repeats: int) -> dict[str, Any]:
    """pagedkv's side of part 2 (see the module docs): ns per block of store, lookup, load."""
    tick = time.thread_time_ns
    n = len(prompts)
    best: dict[str, float] = {}
    counts: dict[str, int] = {}
    for _ in range(repeats):
        loops = {}
        for host in (False, True):
            mgr = make_manager(blocks + 2, n * blocks + blocks if host else 0, min_seen=1)
            for r, p in enumerate(prompts):
                mgr.add_sequence(r, p)
            stores = 0
            c = tick()
            for r, p in enumerate(prompts):
                out = mgr.step([r], [len(p)])
                mgr.free(r)
                if host:
                    stores += len(out.host_stores)
            loops[host] = tick() - c
            if not host:
                continue
            for r, p in enumerate(prompts):
                mgr.add_sequence(n + r, p)
            c = tick()
            for r in range(n):  # the first lookup hashes the prompt's blocks
                mgr.lookup_prefix(n + r)
            hash_and_lookup_ns = tick() - c
            c = tick()
            found = sum(mgr.lookup_prefix(n + r) for r in range(n)) // BLOCK_SIZE
            lookup_ns = tick() - c
            loaded = 0
            c = tick()
            for r, p in enumerate(prompts):
                out = mgr.step([n + r], [len(p)])
                mgr.free(n + r)
                loaded += len(out.host_loads)
            load_ns = tick() - c
            mgr.check_invariants()
        # The same lookups on a device pool that holds every block: the device-only baseline.
        dev = make_manager(n * (blocks + 1) + 1, 0)
        for r, p in enumerate(prompts):
            dev.add_sequence(r, p)
            dev.step([r], [len(p)])
            dev.free(r)
            dev.add_sequence(n + r, p)
            dev.lookup_prefix(n + r)  # hashes the prompt
        c = tick()
        dev_found = sum(dev.lookup_prefix(n + r) for r in range(n)) // BLOCK_SIZE
        device_lookup_ns = tick() - c
        if not (stores and found and loaded and dev_found == found):
            raise RuntimeError(f"host tier did nothing: {stores} stores, {found} blocks found, {loaded} loads")
        figures = {
            "store": (loops[True] - loops[False]) / stores,
            "lookup": lookup_ns / found,
            "load": load_ns / loaded,
            "hash_and_lookup": hash_and_lookup_ns / found,
            "device_lookup": device_lookup_ns / dev_found,
        }
        counts = {"store": stores, "lookup": found, "load": loaded}
        for k, v in figures.items():
            best[k] = min(best.get(k, float("inf")), v)
    return {"ns_per_block": best, "blocks": counts}


def vllm_ops(python: str, hashes: list[list[bytes]], repeats: int, timeout: float = 900) -> dict[str, Any]:
    """vLLM's side of part 2, run by ``python`` (see :mod:`host_tier_vllm`); ``{"skipped":
    why}`` when it cannot run."""
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "hashes.json"
        out = Path(tmp) / "out.json"
        src.write_text(json.dumps([[h.hex() for h in req] for req in hashes]))
        cmd = [
            python,
            str(Path(__file__).with_name("host_tier_vllm.py")),
            str(src),
            str(out),
            "--repeats",
            str(repeats),
        ]
        env = {**os.environ, "VLLM_LOGGING_LEVEL": "ERROR"}
        try:
            p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
        except (OSError, subprocess.TimeoutExpired) as e:
            return {"skipped": f"{python}: {e}"}
        if p.returncode != 0:
            return {"skipped": f"exit {p.returncode}: " + " | ".join((p.stderr or p.stdout).strip().splitlines()[-4:])}
        return json.loads(out.read_text())


# ----------------------------------------------------------------------------- output


def print_sweep(name: str, res: dict[str, Any]) -> None:
    """One workload's table."""
    ideal = res["ideal"]
    rows = [["unbounded cache (bound)", None, None, 100 * ideal["hit_rate"], None, 0, None, None, None, None]]
    for r in res["runs"]:
        label = "no host tier" if not r["host_tokens"] else f"host {r['host_tokens']:,} tok, {r['eviction']}"
        rows.append(
            [
                label,
                r["min_seen"],
                r["host_tokens"] // BLOCK_SIZE,
                100 * r["hit_rate"],
                r["prefill_tokens"],
                r["recomputed_tokens"],
                r["host_hit_tokens"],
                r["host_stored_blocks"],
                r["host_loaded_blocks"],
                r["manager_cpu_s"],
            ]
        )
    w = res["workload"]
    common.print_table(
        f"Host tier on {name} ({w['requests']} requests, {w['prompt_mean']:.0f} prompt tokens on average), "
        f"device pool {res['device_tokens']:,} tokens",
        [
            "host tier",
            "min seen",
            "host blocks",
            "hit rate %",
            "prefill tokens",
            "recomputed",
            "host hit tokens",
            "stored blocks",
            "loaded blocks",
            "manager CPU s",
        ],
        rows,
        footnote="hit rate: prefix-hit tokens (either tier) at each request's first admission / prompt tokens. "
        "recomputed: prefill tokens computed beyond those an unbounded cache computes.",
    )


def print_ops(ops: dict[str, Any]) -> None:
    """Part 2's table."""
    p = ops["pagedkv"]["ns_per_block"]
    v = ops["vllm"]
    rows = []
    for k, what_p, what_v in (
        ("store", "step+free marginal vs no tier", "prepare_store + complete_store"),
        ("lookup", "lookup_prefix", "lookup() per key"),
        ("load", "step (allocation + loads) + free", "prepare_load + touch + complete_load"),
    ):
        vv = None if "skipped" in v else v["ns_per_block"][k]
        rows.append([k, what_p, p[k], what_v, vv, None if vv is None else vv / p[k]])
    tp = p["store"] + p["lookup"] + p["load"]
    tv = None if "skipped" in v else sum(v["ns_per_block"].values())
    rows.append(["store + lookup + load", "", tp, "", tv, None if tv is None else tv / tp])
    rows.append(["(lookup with hashing)", "first lookup_prefix", p["hash_and_lookup"], "", None, None])
    rows.append(["(device-only lookup)", "lookup_prefix, no host tier", p["device_lookup"], "", None, None])
    # pagedkv's manager behind vLLM's offloading interface, timed by host_tier_vllm.py on the same calls.
    for k, ns in ({} if "skipped" in v else v.get("pagedkv_ns_per_block", {})).items():
        vv = v["ns_per_block"][k]
        rows.append([f"{k} (offloading API)", "PagedKVOffloadingManager", ns, "same calls", vv, vv / ns])
    common.print_table(
        f"CPU per block op, {ops['requests']} requests x {ops['blocks']} blocks, same hashes"
        + ("" if "skipped" not in v else f" (vLLM skipped: {v['skipped']})"),
        ["op", "pagedkv timed", "pagedkv ns/block", "vLLM timed", "vLLM ns/block", "vLLM / pagedkv"],
        rows,
    )


def plot(payload: dict[str, Any], path: Path) -> Path:
    """Hit rate and recomputed tokens against host tier size, one column per workload; with both
    eviction policies swept, a third row: ARC's hit rate minus LRU's (percentage points), per
    admission threshold."""
    plt = common.pyplot()
    names = [n for n, r in payload["sweeps"].items() if r]
    both = {"lru", "arc"} <= {r["eviction"] for n in names for r in payload["sweeps"][n]["runs"]}
    rows = 3 if both else 2
    fig, axes = plt.subplots(rows, len(names), figsize=(5 * len(names), 3.5 * rows), squeeze=False)
    for col, name in enumerate(names):
        res = payload["sweeps"][name]
        base = [r for r in res["runs"] if r["host_tokens"] == 0]
        top, bottom = axes[0][col], axes[1][col]
        # One line per (admission threshold, eviction policy), each from the no-tier point.
        # Colour: admission threshold; line style: eviction policy (LRU solid, ARC dashed).
        keys = list(dict.fromkeys((r["min_seen"], r["eviction"]) for r in res["runs"] if r["host_tokens"]))
        colours = {m: f"C{i}" for i, m in enumerate(dict.fromkeys(m for m, _ in keys))}
        for key in keys:
            runs = base + [r for r in res["runs"] if r["host_tokens"] and (r["min_seen"], r["eviction"]) == key]
            x = [max(r["host_tokens"], 1 << 12) for r in runs]
            style = {
                "color": colours[key[0]],
                "ls": "--" if key[1] == "arc" else "-",
                "label": f"min_seen {key[0]}, {key[1]}",
            }
            top.plot(x, [100 * r["hit_rate"] for r in runs], marker="o", **style)
            bottom.plot(x, [r["recomputed_tokens"] / 1e6 for r in runs], marker="s", **style)
        top.axhline(100 * res["ideal"]["hit_rate"], color="k", ls="--", lw=0.8, label="unbounded cache")
        top.set_title(f"{name}: device pool {res['device_tokens']:,} tokens")
        top.set_ylabel("prefix hit rate %")
        top.legend(fontsize=7)
        bottom.set_xlabel("host tier (tokens; leftmost point: none)")
        bottom.set_ylabel("recomputed tokens (millions)")
        for ax in (top, bottom):
            ax.set_xscale("log", base=2)
        if both:
            diff = axes[2][col]
            by = {(r["host_tokens"], r["min_seen"], r["eviction"]): r["hit_rate"] for r in res["runs"]}
            for m in colours:
                hs = [h for (h, mm, e) in by if mm == m and e == "lru" and (h, m, "arc") in by]
                pp = [100 * (by[(h, m, "arc")] - by[(h, m, "lru")]) for h in hs]
                diff.plot(hs, pp, marker="d", color=colours[m], label=f"min_seen {m}")
            diff.axhline(0, color="k", lw=0.8)
            diff.set_xscale("log", base=2)
            diff.set_xlabel("host tier (tokens)")
            diff.set_ylabel("ARC - LRU hit rate (points)")
            diff.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def default_vllm_python() -> str | None:
    """``target/vllm-venv/bin/python`` of this checkout when it exists."""
    p = common.REPO_DIR / "target" / "vllm-venv" / "bin" / "python"
    return str(p) if p.exists() else None


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Parse ``argv``, run the sweeps (or the engine comparison with ``--engine``), print the
    tables, write the JSON and plot under the results folder; returns the JSON payload."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer host sizes and op requests (for run_all)")
    ap.add_argument("--traces-dir", default=None, help="folder with the full traces (default: bundled excerpts)")
    ap.add_argument(
        "--trace",
        type=Path,
        default=None,
        help="another Mooncake-format conversation trace (JSONL with hash_ids) to sweep as 'trace'",
    )
    ap.add_argument("--workloads", nargs="+", default=["mooncake", "azure_conv", "chat"])
    ap.add_argument("--requests", type=int, default=None, help="first N requests of each trace")
    ap.add_argument("--min-seen", nargs="+", type=int, default=[2], help="host admission thresholds to sweep")
    ap.add_argument(
        "--eviction",
        "--evictions",
        dest="evictions",
        nargs="+",
        choices=["lru", "arc"],
        default=["lru", "arc"],
        help="host eviction policies to sweep",
    )
    ap.add_argument("--max-running", type=int, default=64)
    ap.add_argument("--op-requests", type=int, default=2000)
    ap.add_argument("--op-blocks", type=int, default=64)
    ap.add_argument("--op-repeats", type=int, default=3)
    ap.add_argument("--no-ops", action="store_true", help="skip the CPU per block op comparison")
    ap.add_argument("--vllm-python", default=default_vllm_python(), help="interpreter with vLLM (part 2)")
    ap.add_argument("--results-dir", default=str(common.RESULTS_DIR))
    ap.add_argument(
        "--out",
        type=Path,
        default=None,
        help="result JSON (the plot beside it, .png); default RESULTS_DIR/host_tier.json, "
        "with --quick RESULTS_DIR/host_tier_quick.json (a quick run never replaces the full results)",
    )
    ap.add_argument("--no-plot", action="store_true")
    ap.add_argument("--engine", action="store_true", help="run the reference engine comparison instead")
    a, rest = ap.parse_known_args(argv)
    if a.engine:
        return engine_main([*rest, "--results-dir", a.results_dir])
    if rest:
        ap.error(f"unrecognized arguments: {' '.join(rest)}")
    sweeps = QUICK_SWEEPS if a.quick else SWEEPS
    if a.quick:
        a.op_requests = min(a.op_requests, 500)
    streams: dict[str, Stream] = {}
    for name in a.workloads:
        if name == "chat":
            streams[name] = chat_workload()
        else:
            streams[name] = trace_stream(common.load_workload(name, a.traces_dir, a.requests))
    if a.trace is not None:
        from pagedkv.engine.inputs import read_trace_rows  # noqa: PLC0415

        rows = read_trace_rows(a.trace)
        w = common.Workload(
            "trace",
            np.asarray([max(1, r.prompt_tokens) for r in rows], dtype=np.int64),
            np.asarray([max(1, r.output_tokens) for r in rows], dtype=np.int64),
            np.asarray([r.arrival_s or 0.0 for r in rows], dtype=np.float64),
            [list(r.hash_ids or ()) for r in rows] if all(r.hash_ids for r in rows) else None,
            str(a.trace),
        )
        streams["trace"] = trace_stream(w.head(a.requests) if a.requests else w)
        sweeps = {**sweeps, "trace": sweeps["mooncake"]}
    payload: dict[str, Any] = {
        "description": __doc__.split("\n\n")[0],
        "settings": {
            "block_size": BLOCK_SIZE,
            "max_running": a.max_running,
            "min_seen": a.min_seen,
            "evictions": a.evictions,
            "quick": a.quick,
            "pagedkv_version": common.pagedkv_version(),
        },
        "sweeps": {},
    }
    for name, s in streams.items():
        device, hosts = sweeps[name]
        payload["sweeps"][name] = sweep(s, device, hosts, min_seen=a.min_seen, evictions=a.evictions)
        print_sweep(name, payload["sweeps"][name])
    if not a.no_ops:
        prompts = op_stream(a.op_requests, a.op_blocks)
        ops: dict[str, Any] = {"requests": a.op_requests, "blocks": a.op_blocks, "repeats": a.op_repeats}
        ops["pagedkv"] = pagedkv_ops(prompts, a.op_blocks, a.op_repeats)
        ops["vllm"] = (
            vllm_ops(a.vllm_python, op_hashes(prompts, a.op_blocks), a.op_repeats)
            if a.vllm_python
            else {"skipped": "no --vllm-python"}
        )
        payload["ops"] = ops
        print_ops(ops)
    out = a.out or Path(a.results_dir) / ("host_tier_quick.json" if a.quick else "host_tier.json")
    path = common.write_json(out.stem, payload, out.parent)
    print(f"wrote {path}")
    if not a.no_plot:
        print(f"wrote {plot(payload, out.with_suffix('.png'))}")
    return payload


# ----------------------------------------------------------------------------- engine


def engine_main(argv: list[str]) -> dict[str, Any]:
    """``--engine``: the reference engine on SmolLM2 (CPU, fp32, one torch thread) with and
    without a host tier, on a device pool too small for the working set: prefix-hit tokens,
    host-hit tokens, prefill tokens computed, TTFT, goodput and wall time; the outputs of the
    two runs are compared token by token. Workloads: the requests of the Mooncake excerpt's
    first ``--mooncake-conversations`` multi-turn conversations (:func:`mooncake_conversations`,
    in trace order, all submitted at once) with every 512-token hash id shrunk to
    ``--mooncake-id-tokens`` tokens (the sharing structure kept, lengths cut to fit a CPU run)
    and token ids folded into the model's vocabulary, ``--max-tokens`` output tokens each; and :func:`chat_workload`'s
    conversations with user messages and answers shortened (``--chat-*``), every turn's answer
    the model's own greedy output (the next turn's prompt carries it, so this workload runs
    turn by turn in waves: all open conversations' next turns are submitted together). The
    tier's admission threshold defaults to 1 use here (``--host-min-seen``): the sweep shows
    the default of 2 stores too little of a conversation's history before its next turn."""
    import torch  # noqa: PLC0415

    from pagedkv.engine import LLMEngine, SamplingParams  # noqa: PLC0415
    from pagedkv.engine.goodput import ServiceLevelObjective  # noqa: PLC0415

    ap = argparse.ArgumentParser(prog="host_tier.py --engine")
    ap.add_argument("--kv-blocks", type=int, default=96, help="device pool, blocks of 16 tokens (null included)")
    ap.add_argument("--host-cache-bytes", type=int, default=1 << 30)
    ap.add_argument("--host-min-seen", type=int, default=1, help="host tier admission threshold (uses)")
    ap.add_argument("--mooncake-conversations", type=int, default=10)
    ap.add_argument("--mooncake-id-tokens", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--chat-conversations", type=int, default=12)
    ap.add_argument("--chat-turns", type=int, default=4)
    ap.add_argument("--chat-open", type=int, default=6)
    ap.add_argument("--max-tokens-per-step", type=int, default=512)
    ap.add_argument("--slo-ttft", type=float, default=10.0)
    ap.add_argument("--slo-tpot", type=float, default=0.5)
    ap.add_argument("--workloads", nargs="+", default=["mooncake", "chat"])
    ap.add_argument("--results-dir", default=str(common.RESULTS_DIR))
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    slo = ServiceLevelObjective(ttft_s=a.slo_ttft, tpot_s=a.slo_tpot)
    engines = {
        "no host tier": LLMEngine(num_kv_blocks=a.kv_blocks, max_tokens_per_step=a.max_tokens_per_step),
        "host tier": LLMEngine(
            num_kv_blocks=a.kv_blocks,
            max_tokens_per_step=a.max_tokens_per_step,
            host_cache_bytes=a.host_cache_bytes,
            host_admission_min_seen=a.host_min_seen,
        ),
    }
    vocab = engines["host tier"].model.vocab_size
    params = SamplingParams(max_tokens=a.max_tokens, temperature=0.0, ignore_eos=True)
    results: dict[str, Any] = {}
    for wname in a.workloads:
        results[wname] = {}
        outs: dict[str, list[list[int]]] = {}
        for sname, eng in engines.items():
            eng.manager.reset_prefix_cache()
            eng.reset_metrics()
            before = eng.stats()
            t0 = time.perf_counter()
            if wname == "mooncake":
                w = common.load_workload("mooncake")
                idt = a.mooncake_id_tokens
                room = (a.kv_blocks - 1) * BLOCK_SIZE - a.max_tokens
                picked = mooncake_conversations(w, a.mooncake_conversations, max_ids=room // idt)
                hash_ids = w.hash_ids or []
                prompts = [
                    (common.expand_hash_ids(hash_ids[r], len(hash_ids[r]) * idt, block_tokens=idt) % vocab)
                    .astype(np.int64)
                    .tolist()
                    for r in picked
                ]
                got = eng.generate(prompts, params)
                tokens = [o.token_ids for o in got]
            else:
                tokens = _engine_chat(eng, a, params, vocab)
            wall = time.perf_counter() - t0
            m = eng.metrics(slo)
            st = eng.stats()
            outs[sname] = tokens
            results[wname][sname] = {
                "wall_s": wall,
                "requests": m.num_requests,
                "prefix_hit_tokens": int(st.prefix_hits_tokens - before.prefix_hits_tokens),
                "host_hit_tokens": m.host_hit_tokens - int(getattr(before, "host_hits_tokens", 0)),
                "prefill_tokens": m.prefill_tokens,
                "host_stored_blocks": m.host_stored_blocks - int(getattr(before, "host_stores_blocks", 0)),
                "host_loaded_blocks": m.host_loaded_blocks - int(getattr(before, "host_loads_blocks", 0)),
                "ttft_p50_s": m.ttft_p50_s,
                "ttft_p99_s": m.ttft_p99_s,
                "tpot_p50_s": m.tpot_p50_s,
                "goodput_share": m.goodput_share,
                "goodput_requests_per_s": m.goodput_requests_per_s,
                "output_tokens_per_s": m.output_tokens_per_s,
            }
        same = outs["no host tier"] == outs["host tier"]
        results[wname]["outputs_identical"] = same
        rows = [
            [
                f"{wname}: {sname}",
                r["prefix_hit_tokens"],
                r["host_hit_tokens"],
                r["prefill_tokens"],
                1000 * r["ttft_p50_s"],
                1000 * r["ttft_p99_s"],
                100 * r["goodput_share"],
                r["goodput_requests_per_s"],
                r["wall_s"],
            ]
            for sname, r in results[wname].items()
            if isinstance(r, dict)
        ]
        common.print_table(
            f"Reference engine (SmolLM2, CPU), {wname}, device pool {a.kv_blocks} blocks; outputs identical: {same}",
            [
                "workload: system",
                "prefix-hit tokens",
                "host-hit tokens",
                "prefill tokens",
                "TTFT p50 ms",
                "TTFT p99 ms",
                "goodput %",
                "goodput req/s",
                "wall s",
            ],
            rows,
            footnote=f"goodput: TTFT <= {a.slo_ttft:g} s and TPOT <= {a.slo_tpot:g} s.",
        )
    payload = {"settings": vars(a), "results": results}
    path = common.write_json("host_tier_engine", payload, Path(a.results_dir))
    print(f"wrote {path}")
    return payload


def _engine_chat(eng: Any, a: argparse.Namespace, params: Any, vocab: int) -> list[list[int]]:
    """The chat workload on ``eng``, wave by wave; returns every turn's output tokens in order."""
    s = chat_workload(
        a.chat_conversations,
        open_at_once=a.chat_open,
        system_prompts=2,
        system_tokens=64,
        user_mean=24.0,
        answer_mean=float(a.max_tokens),
        min_turns=a.chat_turns,
        max_turns=a.chat_turns,
    )
    # Rebuild the prompts with the model's own answers: turn t's prompt = its predecessor's
    # prompt + the model's answer + its own user message (the stream's new tokens).
    prompts: dict[int, list[int]] = {}
    answers: dict[int, list[int]] = {}
    order: list[list[int]] = []
    pending = list(range(len(s)))
    while pending:
        wave = [r for r in pending if s.after[r] < 0 or s.after[r] in answers]
        pending = [r for r in pending if r not in set(wave)]
        batch = []
        for r in wave:
            prev = s.after[r]
            new = (s.prompts[r][len(s.prompts[prev]) + len(s.outputs[prev]) :] if prev >= 0 else s.prompts[r]) % vocab
            prompts[r] = (prompts[prev] + answers[prev] if prev >= 0 else []) + new.astype(np.int64).tolist()
            batch.append(prompts[r])
        for r, out in zip(wave, eng.generate(batch, params)):
            answers[r] = list(out.token_ids)
        order.extend(answers[r] for r in wave)
    return order


if __name__ == "__main__":
    main()
