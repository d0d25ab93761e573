"""State-space hybrids: prefix hits, KV bytes and manager CPU on a Qwen3-Next-shaped layout.

The layout is Qwen3-Next-80B-A3B's at tensor parallelism 2: 48 layers, every fourth one full
attention (12 layers; 2 KV heads of 256 split over 2 ranks: 1 KiB per token and layer in bf16)
and the other 36 gated delta-net layers, whose recurrent state per layer and rank is a conv
state (3 x 4,096 bf16 = 24 KiB) plus the delta-rule state (16 value heads x 128 x 128 bf16 =
512 KiB). As vLLM sizes such a model, the attention block grows until one attention page holds
a state: 16 x ceil(536 KiB / 16 KiB) = 544 tokens, so a page is 544 KiB and states are cached at
multiples of 544 tokens ("align" mode). Layers go into groups of equal layer counts so that a
block id spans the same bytes in every group: 1 full-attention group of the 12 full layers and
3 state groups of 12 layers each; a block id is 12 pages (6.375 MiB).

Systems, on the same request streams and the same scheduler:

- ``pagedkv``: ``pagedkv.KVCacheManager`` over the four groups (one ``"full"``, three
  ``"state"`` ``KVCacheGroupSpec``); after each step it is told which forward passes completed
  (``commit_all_computed``), and only then are the states those passes wrote published;
- ``vLLM``: vLLM's V1 ``KVCacheManager`` over a ``KVCacheConfig`` of one ``FullAttentionSpec``
  group and three ``MambaSpec(mamba_cache_mode="align")`` groups, told of each new step
  (``new_step_starts``, its same-step guard) when vLLM is importable (run with
  ``target/vllm-venv/bin/python``); otherwise its row is skipped.

Scheduler: ``hybrid.replay`` (identical for both systems; see benchmarks/hybrid.py), with the
block-aligned chunking state groups need: a prefill chunk that does not finish the prompt ends on
a multiple of the block size, and never runs past the prompt's last block boundary before its
last token (so the last whole block of every prompt leaves a cached state, which the next turn of
a conversation can hit). Prompts: Mooncake ``hash_ids`` expanded to tokens (shared ids are shared
prefixes); Azure conversation prompts are unique per request, so their hit rate is 0 by
construction.

Figures per system and trace: KV bytes per request (blocks held at its last decode times the
bytes of a block id; mean and p99), largest number running at once, hit rate (prefix-hit tokens
at first admission / prompt tokens), preemptions, and ns per block op (manager CPU time over
``2 * groups * ceil(tokens / 544)`` per request, the same denominator for both).

Usage: ``target/vllm-venv/bin/python benchmarks/state_hybrid.py [--quick] [--requests N]
[--pool-gib G] [--no-vllm]``; writes ``results/state_hybrid.json``.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
import hybrid  # noqa: E402

import pagedkv  # noqa: E402

NUM_LAYERS = 48
FULL_EVERY = 4  # layers 3, 7, ..., 47 are full attention
BLOCK_SIZE = 544
KV_BYTES_PER_TOKEN_LAYER = 2 * 1 * 256 * 2  # K and V, 1 KV head of 256 per rank, bf16
CONV_STATE = (3, 4096)  # per rank, bf16
DELTA_STATE = (16, 128, 128)  # per rank, bf16
STATE_BYTES = 2 * (math.prod(CONV_STATE) + math.prod(DELTA_STATE))
PAGE_BYTES = BLOCK_SIZE * KV_BYTES_PER_TOKEN_LAYER
LAYERS_PER_GROUP = 12
NUM_GROUPS = NUM_LAYERS // LAYERS_PER_GROUP
BLOCK_BYTES = LAYERS_PER_GROUP * PAGE_BYTES
WATERMARK = 0.01
assert STATE_BYTES <= PAGE_BYTES


def layer_groups() -> list[int]:
    """Group of each layer: 0 for the full layers, 1..3 for the delta-net ones (round robin)."""
    out, k = [], 0
    for i in range(NUM_LAYERS):
        if i % FULL_EVERY == FULL_EVERY - 1:
            out.append(0)
        else:
            out.append(1 + k % 3)
            k += 1
    return out


def aligned_split(start: int, chunk: int, prompt_len: int) -> int:
    """Tokens of a prefill chunk of up to ``chunk`` from ``start``: a chunk that does not finish
    the prompt ends on a block boundary, and stops at the prompt's last boundary before its last
    token (so that state is cached)."""
    end = start + chunk
    if end < prompt_len:
        end = end // BLOCK_SIZE * BLOCK_SIZE
    last = (prompt_len - 1) // BLOCK_SIZE * BLOCK_SIZE
    if start < last < end:
        end = last
    return max(end - start, 0)


class PagedKVState(hybrid.PagedKVHybrid):
    """``pagedkv.KVCacheManager`` over one full and three state groups, committing each step."""

    def __init__(self, num_blocks: int) -> None:
        specs = [pagedkv.KVCacheGroupSpec("full", BLOCK_SIZE, KV_BYTES_PER_TOKEN_LAYER)] + [
            pagedkv.KVCacheGroupSpec("state", BLOCK_SIZE, KV_BYTES_PER_TOKEN_LAYER, state_bytes=STATE_BYTES)
            for _ in range(3)
        ]
        self.m = pagedkv.KVCacheManager(pagedkv.CacheConfig(num_blocks, groups=specs, layer_groups=layer_groups()))
        self.reserve = math.ceil(WATERMARK * num_blocks)
        self.cpu_ns = 0
        self.scheduled: set[int] = set()

    def admit(self, r: int, prompt: np.ndarray, chunk: int) -> tuple[int, int] | None:
        m = self.m
        t0 = time.thread_time_ns()
        m.add_sequence(r, prompt)
        hit = int(m.lookup_prefix(r))
        q = aligned_split(hit, min(chunk, len(prompt) - hit), len(prompt))
        if q == 0:  # the budget left does not reach a block boundary: next step
            m.free(r)
            self.cpu_ns += time.thread_time_ns() - t0
            return None
        out = m.step([r], q, reserve_blocks=self.reserve, **hybrid.SCHEDULER_OUTPUT)
        if out.num_scheduled == 0:
            m.free(r)
            self.cpu_ns += time.thread_time_ns() - t0
            if not isinstance(out.error, pagedkv.OutOfBlocksError):
                out.raise_for_error()
            return None
        self.cpu_ns += time.thread_time_ns() - t0
        self.scheduled.add(r)
        return int(out.num_cached_tokens[0]), q

    def prefill(self, r: int, chunk: int) -> bool:
        ok = super().prefill(r, chunk)
        if ok:
            self.scheduled.add(r)
        return ok

    def decode(self, rs: list[int], toks: np.ndarray) -> int:
        k = super().decode(rs, toks)
        self.scheduled.update(rs[:k])
        return k

    def free(self, r: int) -> None:
        """A preemption: the step that scheduled ``r`` (if any) never ran, nothing to commit."""
        self.scheduled.discard(r)
        super().free(r)

    def finish(self, r: int) -> None:
        """``r`` leaves after its last step's forward pass: commit it, then free."""
        t0 = time.thread_time_ns()
        if r in self.scheduled:
            self.m.commit_all_computed([r])
        self.cpu_ns += time.thread_time_ns() - t0
        self.free(r)

    def end_step(self) -> None:
        """The step's forward passes completed: publish the states they wrote."""
        t0 = time.thread_time_ns()
        self.m.commit_all_computed(np.fromiter(self.scheduled, dtype=np.uint64, count=len(self.scheduled)))
        self.cpu_ns += time.thread_time_ns() - t0
        self.scheduled.clear()


class VLLMState(hybrid.VLLMHybrid):
    """vLLM's ``KVCacheManager`` over one ``FullAttentionSpec`` and three align-mode ``MambaSpec``."""

    def __init__(self, num_blocks: int, max_len: int) -> None:  # noqa: D107
        import torch  # noqa: PLC0415
        from vllm.sampling_params import SamplingParams  # noqa: PLC0415
        from vllm.utils.hashing import get_hash_fn_by_name  # noqa: PLC0415
        from vllm.v1.core.kv_cache_manager import KVCacheManager  # noqa: PLC0415
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash  # noqa: PLC0415
        from vllm.v1.kv_cache_interface import (  # noqa: PLC0415
            FullAttentionSpec,
            KVCacheConfig,
            KVCacheGroupSpec,
            MambaSpec,
        )
        from vllm.v1.request import Request, RequestStatus  # noqa: PLC0415

        full = FullAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=1, head_size=256, dtype=torch.bfloat16)
        state = MambaSpec(
            block_size=BLOCK_SIZE,
            shapes=(CONV_STATE, DELTA_STATE),
            dtypes=(torch.bfloat16, torch.bfloat16),
            page_size_padded=PAGE_BYTES,
            mamba_cache_mode="align",
        )
        lg = layer_groups()
        names = [[f"model.layers.{i}" for i in range(NUM_LAYERS) if lg[i] == g] for g in range(NUM_GROUPS)]
        groups = [KVCacheGroupSpec(names[0], full)] + [KVCacheGroupSpec(names[g], state) for g in range(1, NUM_GROUPS)]
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
        q = aligned_split(n, min(chunk, req.num_tokens - n), req.num_tokens)
        got = None if q == 0 else kvm.allocate_slots(req, q, num_new_computed_tokens=n, new_computed_blocks=blocks)
        self.cpu_ns += time.thread_time_ns() - t0
        if got is None:
            return None
        req.status = self.RUNNING
        req.num_computed_tokens = n + q
        self.reqs[r] = req
        return int(n), q

    def end_step(self) -> None:
        """A new step starts: vLLM's same-step guard (states cached this step) resets."""
        t0 = time.thread_time_ns()
        self.kvm.new_step_starts()
        self.cpu_ns += time.thread_time_ns() - t0


def run(workloads: list[common.Workload], pool_bytes: int, use_vllm: bool = True) -> dict[str, Any]:
    """Replay every workload through both systems; returns the result payload (module doc)."""
    num_blocks = pool_bytes // BLOCK_BYTES
    vversion = hybrid.vllm_available() if use_vllm else None
    results: dict[str, Any] = {}
    for w in workloads:
        prompts = hybrid.prompts_of(w)
        max_len = int((w.prompt_lens + w.output_lens).max())
        systems: dict[str, Any] = {"pagedkv": lambda: PagedKVState(num_blocks)}
        if vversion:
            systems["vLLM"] = lambda m=max_len: VLLMState(num_blocks, m)
        res: dict[str, Any] = {"vLLM": None}
        for name, make in systems.items():
            got = hybrid.replay(make(), w, prompts, BLOCK_BYTES, NUM_GROUPS, split=aligned_split)
            # hybrid.replay counts block ops at its own block size; use this layout's.
            total = w.prompt_lens + np.maximum(w.output_lens - 1, 0)
            got["block_ops"] = int(2 * NUM_GROUPS * np.ceil(total / BLOCK_SIZE).sum())
            got["ns_per_block_op"] = got["cpu_ms"] * 1e6 / got["block_ops"]
            res[name] = got
        results[w.name] = {"workload": w.describe(), "systems": res}
    return {
        "model": {
            "layers": NUM_LAYERS,
            "layer_groups": layer_groups(),
            "block_size": BLOCK_SIZE,
            "page_bytes": PAGE_BYTES,
            "state_bytes": STATE_BYTES,
            "groups": NUM_GROUPS,
        },
        "pool_bytes": pool_bytes,
        "num_blocks": num_blocks,
        "vllm": vversion,
        "commit": common.git_commit(),
        "pagedkv": common.pagedkv_version(),
        "results": results,
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Parse the command line, run, print the table and write ``results/state_hybrid.json``."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="first 100 requests of each trace")
    ap.add_argument("--requests", type=int, default=None, help="first N requests of each trace")
    ap.add_argument("--pool-gib", type=float, default=64.0, help="KV pool size in GiB (default 64)")
    ap.add_argument("--traces-dir", default=None)
    ap.add_argument("--results-dir", default=str(common.RESULTS_DIR))
    ap.add_argument("--no-vllm", action="store_true", help="skip vLLM even when importable")
    a = ap.parse_args(argv)
    n = 100 if a.quick and a.requests is None else a.requests
    workloads = [common.load_workload(t, a.traces_dir, n) for t in ("mooncake", "azure_conv")]
    payload = run(workloads, int(a.pool_gib * 2**30), use_vllm=not a.no_vllm)
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
        f"Qwen3-Next-shaped layout (48 layers, 36 delta-net, block {BLOCK_SIZE}), KV pool {a.pool_gib:g} GiB"
        + (f", first {n} requests" if n else ""),
        ["trace: system", "KV MiB/req mean", "KV MiB/req p99", "max concurrent", "hit %", "preemptions", "ns/block op"],
        rows,
        footnote="ns/block op: manager CPU time / (block-table entries allocated + freed); see module docstring.",
    )
    for tname, r in payload["results"].items():
        p, v = r["systems"]["pagedkv"], r["systems"].get("vLLM")
        if v is not None:
            print(
                f"{tname}: hit rate pagedkv {100 * p['hit_rate']:.2f} % vs vLLM {100 * v['hit_rate']:.2f} %, "
                f"CPU per block op {v['ns_per_block_op'] / p['ns_per_block_op']:.1f}x less (goal 20x)"
            )
    path = common.write_json("state_hybrid", payload, Path(a.results_dir))
    print(f"wrote {path}")
    return payload


if __name__ == "__main__":
    main()
