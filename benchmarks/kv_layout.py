"""Paged vs virtual KV layout on one runtime (issue 27; vAttention, Prabhu et al., arXiv
2405.04437, against PagedAttention, Kwon et al., SOSP'23), at equal physical budgets.

Two parts, each labelled in the output:

1. **Allocator replay** (no model) of the ShareGPT-like, Azure conversation and Mooncake traces:
   one FCFS chunked-prefill scheduler with the engine's admission rule (whole prompt plus one
   unit of headroom per running request) and recompute preemption of the newest request, over
   (a) paged blocks (``--block-size``) and (b) the real :class:`VirtualKVLayout` (its arena's
   pages are committed by touch and returned with ``MADV_DONTNEED``, so its page faults are the
   OS's own ``ru_minflt``), with SmolLM2-135M's KV shape (30 layers, 3 KV heads x 64, fp32:
   768 bytes per token per layer's K or V). Per step: committed bytes vs bytes holding tokens
   (waste: tail of block for paged, tail of page for virtual), admissions, preemptions; TTFT and
   TPOT in *steps* (no model, so no seconds). Mooncake's ``hash_ids`` give the prefix each
   request shares with earlier ones: the bytes each layout could share (whole blocks vs whole
   pages) are reported beside it.
2. **Engine runs** (real model, SmolLM2 fp32 CPU, 1 torch thread) of ``examples/prompts.jsonl``
   through ``LLMEngine`` with ``kv_layout="paged"`` and ``"virtual"`` at equal ``num_kv_blocks``:
   TTFT, TPOT, goodput, preemptions, minor faults of the run, attention time per step (paged:
   the reference kernels' cache write + attention; virtual: the layout's write + attention).
3. **Engine sharing** (same model, prefix caching on): the prompts of part 2 sent twice
   (repeats), behind one long shared system prompt, and with ``n = 4`` samples each (forks),
   through the paged layout and the virtual one at each ``--share-pages`` page size: prefix-hit
   tokens (the engine's ``num_cached_tokens``), the virtual layout's shared pages (mapped, not
   copied), copy-on-write pages and peak committed bytes, tokens equal to the paged run.

Writes ``results/kv_layout.json`` and ``results/kv_layout.png`` (``--quick``:
``results/kv_layout_quick.*``, so a quick run never replaces the full figures).

    python benchmarks/kv_layout.py                      # default, about 8 minutes on 2 quiet cores
    python benchmarks/kv_layout.py --requests 120 --prompts 16   # the figures in docs/design/virtual-layout.md
    python benchmarks/kv_layout.py --quick              # fewer requests, no engine run
"""

from __future__ import annotations

import argparse
import os
import resource
import sys
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS_DIR, load_workload, print_table, pyplot, write_json  # noqa: E402

GiB = 1024**3
# SmolLM2-135M's KV: 30 layers, 3 KV heads x 64 dims, fp32
LAYERS, KV_HEADS, HEAD, ELEM = 30, 3, 64, 4
SEG_BYTES_PER_TOKEN = KV_HEADS * HEAD * ELEM  # one layer's K (or V)
TOKEN_BYTES = 2 * LAYERS * SEG_BYTES_PER_TOKEN  # all layers, K and V


def minflt() -> int:
    """This process's minor page faults so far (``ru_minflt``)."""
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_minflt)


# ------------------------------------------------------------------------------ allocator replay


class PagedCapacity:
    """Blocks of ``block_size`` tokens per sequence (what the paged pool holds), exact counts."""

    def __init__(self, budget: int, block_size: int) -> None:
        self.bs = block_size
        self.total = budget // (block_size * TOKEN_BYTES)
        self.used = 0
        self.held: dict[int, int] = {}
        self.unit_bytes = block_size * TOKEN_BYTES

    def units(self, tokens: int) -> int:
        return -(-tokens // self.bs)

    def grow(self, rid: int, tokens: int) -> bool:
        need = self.units(tokens) - self.held.get(rid, 0)
        if need > self.total - self.used:
            return False
        if need > 0:
            self.used += need
            self.held[rid] = self.held.get(rid, 0) + need
        return True

    def owed(self, rid: int, tokens: int) -> int:
        return max(0, self.units(tokens) - self.held.get(rid, 0))

    def release(self, rid: int) -> None:
        self.used -= self.held.pop(rid, 0)

    @property
    def free(self) -> int:
        return self.total - self.used

    def committed_bytes(self) -> int:
        return self.used * self.unit_bytes

    def faults(self) -> int:
        return 0  # the pool is allocated (and faulted in) once, before serving


class VirtualCapacity:
    """The engine's :class:`VirtualKVLayout` itself (real reserved memory, real faults)."""

    def __init__(self, budget: int, page_size: int, max_seqs: int, max_len: int) -> None:
        import torch

        from pagedkv.engine.virtual.layout import VirtualKVLayout

        self.lay = VirtualKVLayout(
            num_layers=LAYERS,
            num_kv_heads=KV_HEADS,
            head_size=HEAD,
            dtype=torch.float32,
            page_size=page_size,
            budget_bytes=budget,
            max_seqs=max_seqs,
            max_seq_len=max_len,
        )
        self.unit_bytes = page_size

    def grow(self, rid: int, tokens: int) -> bool:
        return self.lay.ensure(rid, tokens)

    def owed(self, rid: int, tokens: int) -> int:
        return self.lay.pages_to_grow(rid, tokens)

    def release(self, rid: int) -> None:
        self.lay.release(rid)

    @property
    def free(self) -> int:
        return self.lay.num_free_pages

    def committed_bytes(self) -> int:
        return self.lay.used_pages * self.lay.page_size

    def faults(self) -> int:
        return self.lay.arena.faults


@dataclass
class Req:
    """One replayed request: ``prompt`` and ``output`` lengths in tokens, ``computed`` so far."""

    rid: int
    prompt: int
    output: int
    computed: int = 0
    generated: int = 0
    first_step: int | None = None
    last_step: int | None = None
    arrival_step: int = 0
    preemptions: int = 0
    reserved: bool = False
    tokens_seen: list[int] = field(default_factory=list)

    @property
    def total(self) -> int:  # tokens the request has (prompt + generated)
        return self.prompt + self.generated


def replay(
    cap: PagedCapacity | VirtualCapacity,
    prompts: np.ndarray,
    outputs: np.ndarray,
    budget_tokens: int,
    max_seqs: int,
    headroom_unit: int = 1,
) -> dict:
    """Serve every request to completion (all queued at step 0); returns the layout's figures.
    ``headroom_unit``: capacity units of decode headroom per running request at admission (1,
    the engine's rule: one block, or one page; 60 = one page in each segment, what a growing
    request of this KV shape takes at once under the virtual layout)."""
    waiting = deque(Req(i, int(p), int(o)) for i, (p, o) in enumerate(zip(prompts, outputs)))
    running: list[Req] = []
    done: list[Req] = []
    step = admissions = preemptions = 0
    committed, holding = [], []
    f0 = cap.faults()
    t0 = time.perf_counter()
    while waiting or running:
        budget = budget_tokens
        sched: list[tuple[Req, int]] = []
        # 1. running requests, oldest first: a decode or the next prefill chunk
        for r in list(running):
            if budget == 0:
                break
            if r not in running:  # preempted earlier in this step
                continue
            n = min(r.total - r.computed, budget)
            if n <= 0:
                continue
            while not cap.grow(r.rid, r.computed + n):
                scheduled = {id(s) for s, _ in sched}
                victims = [v for v in running if v is not r and id(v) not in scheduled]
                if not victims:
                    n = 0
                    break
                v = ([v for v in victims if not v.reserved] or victims)[-1]  # the newest
                cap.release(v.rid)
                running.remove(v)
                v.computed, v.reserved = 0, False
                v.preemptions += 1
                preemptions += 1
                waiting = deque(sorted([*waiting, v], key=lambda x: x.rid))  # FCFS by arrival
            if n:
                sched.append((r, n))
                budget -= n
        # 2. admission: whole remaining prefill + one unit per running request
        free = cap.free - sum(cap.owed(r.rid, r.total) for r in running if r.reserved)
        headroom = headroom_unit * len(running)
        while waiting and budget > 0 and len(running) < max_seqs:
            r = waiting[0]
            need = cap.owed(r.rid, r.total)
            if need + headroom > free and running:
                break
            waiting.popleft()
            running.append(r)
            running.sort(key=lambda x: x.rid)
            r.reserved = True
            admissions += 1
            free -= need
            headroom += headroom_unit
            n = min(r.total, budget)
            if cap.grow(r.rid, n):
                sched.append((r, n))
                budget -= n
        # 3. the step: prefill chunks and decodes advance; a completed prefill samples a token
        for r, n in sched:
            r.computed += n
            if r.computed == r.total:
                r.reserved = False
                r.generated += 1
                r.first_step = step if r.first_step is None else r.first_step
                r.last_step = step
                if r.generated >= r.output:
                    cap.release(r.rid)
                    running.remove(r)
                    done.append(r)
        committed.append(cap.committed_bytes())
        holding.append(sum(r.computed for r in running) * TOKEN_BYTES)
        step += 1
    elapsed = time.perf_counter() - t0
    c, h = np.asarray(committed, dtype=np.float64), np.asarray(holding, dtype=np.float64)
    busy = c > 0
    ttft = np.asarray([r.first_step for r in done], dtype=np.float64)
    tpot = np.asarray(
        [(r.last_step - r.first_step) / (r.generated - 1) for r in done if r.generated > 1], dtype=np.float64
    )
    return {
        "steps": step,
        "admissions": admissions,
        "preemptions": preemptions,
        "mean_committed_mib": float(c[busy].mean() / 2**20),
        "mean_token_mib": float(h[busy].mean() / 2**20),
        "waste_share": float(1 - h[busy].sum() / c[busy].sum()),
        "page_faults": cap.faults() - f0,
        "ttft_p50_steps": float(np.percentile(ttft, 50)),
        "tpot_mean_steps": float(tpot.mean()) if tpot.size else None,
        "replay_s": elapsed,
    }


def sharing(hash_ids: list[list[int]], prompts: np.ndarray, block_size: int, page_size: int) -> dict:
    """Mooncake: bytes of prompt prefixes seen in earlier requests (512-token hash blocks) that
    each layout can share: whole blocks (paged) or whole pages of each segment (virtual)."""
    seen: set[int] = set()
    shared_tokens = paged = virtual = total = 0
    for ids, p in zip(hash_ids, prompts):
        k = 0
        while k < len(ids) and ids[k] in seen:
            k += 1
        s = min(k * 512, int(p) - 1)
        shared_tokens += s
        paged += (s // block_size) * block_size * TOKEN_BYTES
        virtual += (s * SEG_BYTES_PER_TOKEN // page_size) * page_size * 2 * LAYERS
        total += int(p) * TOKEN_BYTES
        seen.update(ids)
    return {
        "shared_prefix_share": shared_tokens * TOKEN_BYTES / total,
        "paged_sharable_share": paged / total,
        "virtual_sharable_share": virtual / total,
    }


# ------------------------------------------------------------------------------ engine runs


def engine_runs(args: argparse.Namespace) -> list[dict]:
    """SmolLM2 over ``examples/prompts.jsonl`` through the paged layout and the virtual one at
    each page size of ``--engine-pages``, at one KV budget; one row per run (TTFT, TPOT, goodput, attention ms per
    step, page faults, token identity with the paged run)."""
    import torch

    from pagedkv import kernels
    from pagedkv.engine import LLMEngine, SamplingParams
    from pagedkv.engine.inputs import read_prompts
    from pagedkv.engine.models.loader import load_hf_model

    torch.set_num_threads(1)
    hf, tok = load_hf_model()
    prompts = read_prompts(Path(__file__).resolve().parent.parent / "examples" / "prompts.jsonl")[: args.prompts]
    prompts = [{**p, "max_tokens": min(p.get("max_tokens", args.max_tokens), args.max_tokens)} for p in prompts]
    timed = {"s": 0.0}
    orig = (kernels.reshape_and_cache, kernels.paged_attention)

    def timing(fn):
        def wrapper(*a, **kw):
            t = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                timed["s"] += time.perf_counter() - t

        return wrapper

    runs: dict[str, list[dict]] = {}
    configs = [("paged", None)] + [("virtual", p) for p in args.engine_pages]
    order = [configs[(i + r) % len(configs)] for r in range(args.repeats) for i in range(len(configs))]
    for layout, page in order:  # round-robin, the start rotated each round (a shared, noisy machine)
        kw = dict(num_kv_blocks=args.kv_blocks, block_size=16, enable_prefix_caching=False)
        if layout == "virtual":
            kw.update(kv_layout="virtual", page_size=page)
        engine = LLMEngine(hf, tokenizer=tok, **kw)
        timed["s"] = 0.0
        kernels.reshape_and_cache, kernels.paged_attention = (timing(f) for f in orig)
        f0 = minflt()
        try:
            outs = engine.generate(prompts, SamplingParams(max_tokens=args.max_tokens), chat_template=True)
        finally:
            kernels.reshape_and_cache, kernels.paged_attention = orig
        faults = minflt() - f0
        m = engine.metrics()
        attn = timed["s"] if layout == "paged" else engine.layout.stats().attention_s
        row = {
            "layout": layout if page is None else f"virtual {page // 1024} KiB",
            "requests": m.num_requests,
            "preemptions": m.preemptions,
            "steps": m.num_steps,
            "ttft_p50_s": m.ttft_p50_s,
            "tpot_p50_s": m.tpot_p50_s,
            "goodput_share": m.goodput_share,
            "goodput_requests_per_s": m.goodput_requests_per_s,
            "output_tokens_per_s": m.output_tokens_per_s,
            "attention_ms_per_step": 1000 * attn / max(1, m.num_steps),
            "minor_faults": faults,
            "tokens": [list(o.token_ids) for o in outs],
            "load_average_1m": os.getloadavg()[0],
        }
        if layout == "virtual":
            st = engine.layout.stats()
            row["layout_faults"] = st.page_faults
            row["peak_committed_mib"] = st.peak_committed_bytes / 2**20
            row["resident_after_mib"] = st.resident_bytes / 2**20
        runs.setdefault(row["layout"], []).append(row)
        print(f"engine {row['layout']}: {m.elapsed_s:.1f} s", file=sys.stderr)
    reference = runs["paged"][0]["tokens"]
    rows = []
    for reps in runs.values():  # the run with the least attention time of each layout
        best = dict(min(reps, key=lambda r: r["attention_ms_per_step"]))
        best["tokens_equal_paged"] = all(r["tokens"] == reference for r in reps)
        best["repeats"] = [{k: v for k, v in r.items() if k != "tokens"} for r in reps]
        del best["tokens"]
        rows.append(best)
    return rows


def engine_sharing(args: argparse.Namespace) -> list[dict]:
    """SmolLM2 with prefix caching on, paged vs virtual at each page of ``--share-pages``, at
    one budget, over the first ``--prompts`` lines of ``examples/prompts.jsonl`` in the chat
    template (the library lines share one system prompt): per workload (``repeat``: the prompts
    twice, figures of the second pass; ``system``: one warm-up request, then every prompt, so
    the shared system prompt is cached; ``fork``: ``n = 4`` samples per prompt) the prefix-hit
    tokens, the prompt tokens, and for the virtual layout the pages shared and copied and the
    peak committed MiB. One row per layout and workload; ``tokens_equal_paged`` compares the
    completions with the paged run's."""
    import torch

    from pagedkv.engine import LLMEngine, SamplingParams
    from pagedkv.engine.errors import RequestTooLargeError
    from pagedkv.engine.inputs import read_prompts
    from pagedkv.engine.models.loader import load_hf_model

    torch.set_num_threads(1)
    hf, tok = load_hf_model()
    lines = read_prompts(Path(__file__).resolve().parent.parent / "examples" / "prompts.jsonl")[: args.prompts]
    plain = [{k: v for k, v in p.items() if k != "max_tokens"} for p in lines]  # --share-tokens for all
    greedy = SamplingParams(max_tokens=args.share_tokens)
    sampled = SamplingParams(max_tokens=args.share_tokens, n=4, temperature=0.8, seed=3)
    rows, reference = [], {}
    for page in [None, *args.share_pages]:
        layout = "paged" if page is None else f"virtual {page // 1024} KiB"
        for workload in ("repeat", "system", "fork"):
            kw = dict(num_kv_blocks=args.share_kv_blocks, block_size=16, enable_prefix_caching=True)
            if page is not None:
                kw.update(kv_layout="virtual", page_size=page)
            engine = LLMEngine(hf, tokenizer=tok, **kw)
            if workload == "repeat":
                engine.generate(plain, greedy, chat_template=True)
                outs = engine.generate(plain, greedy, chat_template=True)
            elif workload == "system":
                engine.generate(plain[:1], greedy, chat_template=True)  # caches the shared system prompt
                outs = engine.generate(plain, greedy, chat_template=True)
            else:
                try:
                    outs = engine.generate(plain, sampled, chat_template=True)
                except RequestTooLargeError as e:  # 2 MiB: every sample needs its own 60 pages
                    rows.append({"layout": layout, "workload": workload, "refused": str(e)})
                    print(f"sharing {layout} {workload}: refused ({e})", file=sys.stderr)
                    continue
            tokens = [[list(c.token_ids) for c in o.outputs] for o in outs]
            reference.setdefault(workload, tokens)
            row = {
                "layout": layout,
                "workload": workload,
                "prompt_tokens": sum(len(o.prompt_token_ids) for o in outs),
                "hit_tokens": sum(o.num_cached_tokens for o in outs),
                "tokens_equal_paged": tokens == reference[workload],
            }
            if page is not None:
                st = engine.layout.stats()
                row.update(
                    shared_pages=st.shared_pages,
                    cow_pages=st.cow_pages,
                    peak_committed_mib=st.peak_committed_bytes / 2**20,
                    peak_used_mib=st.peak_used_bytes / 2**20,
                    bytes_per_token=engine.layout.bytes_per_token,
                    tokens_per_page=page / engine.layout.bytes_per_token,
                )
                engine.layout.close()
            else:
                row["peak_blocks"] = engine.metrics().peak_blocks_used
                row["peak_used_mib"] = row["peak_blocks"] * 16 * TOKEN_BYTES / 2**20
            rows.append(row)
            print(f"sharing {layout} {workload}: {row['hit_tokens']} hit tokens", file=sys.stderr)
    return rows


# ------------------------------------------------------------------------------ main


def print_sharing(shares: list[dict], args: argparse.Namespace) -> None:
    """Print the engine sharing rows of :func:`engine_sharing` as a table."""
    print_table(
        f"Engine sharing (SmolLM2 fp32, prefix caching on, {args.share_kv_blocks} blocks of 16): prefix-hit "
        "tokens, pages mapped into a second range (shared) and copied before a write (copy-on-write)",
        [
            "layout",
            "workload",
            "prompt tokens",
            "hit tokens",
            "shared pages",
            "COW pages",
            "peak MiB in use",
            "tokens / page",
            "same tokens",
        ],  # fmt: skip
        [
            [r["layout"], r["workload"], "refused (never fits)", *["-"] * 6]
            if "refused" in r
            else [
                r["layout"],
                r["workload"],
                r["prompt_tokens"],
                r["hit_tokens"],
                r.get("shared_pages", "-"),
                r.get("cow_pages", "-"),
                r["peak_used_mib"],
                f"{r['tokens_per_page']:.1f}" if "tokens_per_page" in r else "-",
                "yes" if r["tokens_equal_paged"] else "NO",
            ]
            for r in shares
        ],  # fmt: skip
        footnote="repeat: second pass of the same prompts; system: every prompt behind one shared system "
        "prompt (cached by a warm-up request); fork: n = 4 samples. Paged hits are whole blocks of 16 tokens; "
        "virtual hits are the whole tokens of the matched page groups (at most prompt - 1). Peak MiB in use: "
        "held by sequences (paged: blocks referenced; virtual: pages mapped, shared ones once).",
    )


def main() -> None:
    """Parse the flags, run the replay (and the engine unless ``--quick``), print the tables,
    write ``results/kv_layout.json`` and the plot."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=100, help="requests taken from each trace")
    ap.add_argument("--budget-gib", type=float, default=1.0, help="physical KV budget of the replay")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--pages", type=int, nargs="+", default=[4096, 65536, 2 * 1024 * 1024])
    ap.add_argument("--max-seqs", type=int, default=128)
    ap.add_argument("--step-tokens", type=int, default=2048, help="token budget per step (chunked prefill)")
    ap.add_argument("--traces-dir", default=None)
    ap.add_argument("--prompts", type=int, default=12, help="examples/prompts.jsonl lines for the engine runs")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--kv-blocks", type=int, default=64, help="engine pool (both layouts' budget), blocks of 16")
    ap.add_argument("--engine-pages", type=int, nargs="+", default=[65536, 4096])
    ap.add_argument("--repeats", type=int, default=2, help="engine runs per layout (best attention time shown)")
    ap.add_argument("--share-pages", type=int, nargs="+", default=[4096, 65536, 2 * 1024 * 1024])
    ap.add_argument("--share-kv-blocks", type=int, default=512, help="sharing runs' pool, blocks of 16")
    ap.add_argument("--share-tokens", type=int, default=8, help="max_tokens of the sharing runs")
    ap.add_argument("--quick", action="store_true", help="40 requests per trace, no engine run")
    args = ap.parse_args()
    if args.quick:
        args.requests = 40
    budget = int(args.budget_gib * GiB)
    traces = {}
    for name in ("sharegpt_like", "azure_conv", "mooncake"):
        w = load_workload(name, args.traces_dir, n=args.requests if name == "sharegpt_like" else None)
        w = w.head(args.requests)
        # clip to what the budget can hold alone (one request must always fit)
        cap_tokens = budget // TOKEN_BYTES - 2 * args.block_size
        p = np.minimum(w.prompt_lens, cap_tokens // 2)
        o = np.minimum(w.output_lens, cap_tokens - p)
        traces[name] = (w, p, o)
    replay_rows = []
    for name, (_w, p, o) in traces.items():
        max_len = int((p + o).max()) + 1
        res = replay(PagedCapacity(budget, args.block_size), p, o, args.step_tokens, args.max_seqs)
        replay_rows.append({"trace": name, "layout": f"paged bs={args.block_size}", **res})
        for page in args.pages:
            cap = VirtualCapacity(budget, page, args.max_seqs, max_len)
            res = replay(cap, p, o, args.step_tokens, args.max_seqs)
            res["resident_after_mib"] = cap.lay.stats().resident_bytes / 2**20
            cap.lay.close()
            replay_rows.append({"trace": name, "layout": f"virtual {page // 1024} KiB", **res})
        # the same at 64 KiB with the headroom a growing request really takes (a page per segment)
        cap = VirtualCapacity(budget, 65536, args.max_seqs, max_len)
        res = replay(cap, p, o, args.step_tokens, args.max_seqs, headroom_unit=2 * LAYERS)
        cap.lay.close()
        replay_rows.append({"trace": name, "layout": "virtual 64 KiB, 60-page headroom", **res})
        print(f"replayed {name}", file=sys.stderr)
    w, p, _ = traces["mooncake"]
    share = {page: sharing(w.hash_ids or [], p, args.block_size, page) for page in args.pages}
    cols = ["trace", "layout", "steps", "admissions", "preemptions", "committed MiB", "holding tokens MiB",
            "waste", "page faults", "TTFT p50 (steps)", "TPOT (steps)"]  # fmt: skip
    print_table(
        f"Allocator replay (no model), {args.budget_gib:g} GiB budget, SmolLM2 KV shape, {args.requests} requests",
        cols,
        [
            [
                r["trace"],
                r["layout"],
                r["steps"],
                r["admissions"],
                r["preemptions"],
                r["mean_committed_mib"],
                r["mean_token_mib"],
                f"{100 * r['waste_share']:.2f}%",
                r["page_faults"],
                r["ttft_p50_steps"],
                r["tpot_mean_steps"],
            ]  # fmt: skip
            for r in replay_rows
        ],
        footnote="waste: paged = tail of each request's last block; virtual = tail of the last page of each of "
        "its 60 segments (30 layers x K, V). Paged faults: 0 per request (pool faulted in once).",
    )
    print_table(
        "Mooncake prefix sharing (prompt bytes shared with earlier requests, 512-token hash blocks)",
        ["page", "shared prefix", f"paged sharable (bs={args.block_size})", "virtual sharable (whole pages)"],
        [
            [
                f"{pg // 1024} KiB",
                f"{100 * s['shared_prefix_share']:.1f}%",
                f"{100 * s['paged_sharable_share']:.1f}%",
                f"{100 * s['virtual_sharable_share']:.1f}%",
            ]
            for pg, s in share.items()
        ],  # fmt: skip
    )
    eng = [] if args.quick else engine_runs(args)
    if eng:
        print_table(
            f"Engine runs (SmolLM2 fp32, 1 thread): examples/prompts.jsonl first {args.prompts}, max_tokens "
            f"{args.max_tokens}, {args.kv_blocks} blocks of 16 = equal budget",
            [
                "layout",
                "steps",
                "preemptions",
                "TTFT p50 s",
                "TPOT p50 s",
                "goodput",
                "tok/s",
                "attn ms/step",
                "minor faults",
                "same tokens",
            ],  # fmt: skip
            [
                [
                    r["layout"],
                    r["steps"],
                    r["preemptions"],
                    r["ttft_p50_s"],
                    r["tpot_p50_s"],
                    f"{100 * r['goodput_share']:.0f}%",
                    r["output_tokens_per_s"],
                    r["attention_ms_per_step"],
                    r["minor_faults"],
                    "yes" if r["tokens_equal_paged"] else "NO",
                ]
                for r in eng
            ],  # fmt: skip
        )
    shares = [] if args.quick else engine_sharing(args)
    if shares:
        print_sharing(shares, args)
    name = "kv_layout_quick" if args.quick else "kv_layout"  # a quick run keeps the full figures
    path = write_json(name, {"args": vars(args), "replay": replay_rows, "mooncake_sharing": share,
                             "engine": eng, "engine_sharing": shares})  # fmt: skip
    plot(replay_rows, args, RESULTS_DIR / f"{name}.png")
    print(f"wrote {path}")


def plot(rows: list[dict], args: argparse.Namespace, out: Path) -> None:
    """Bars of the replay's waste, preemptions and page faults per trace and layout, to ``out`` (PNG)."""
    plt = pyplot()
    traces = list(dict.fromkeys(r["trace"] for r in rows))
    layouts = list(dict.fromkeys(r["layout"] for r in rows))
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for ax, key, label in [
        (axes[0], "waste_share", "committed bytes not holding tokens"),
        (axes[1], "preemptions", "preemptions"),
        (axes[2], "page_faults", "minor page faults (replay)"),
    ]:
        x = np.arange(len(traces))
        wdt = 0.8 / len(layouts)
        for j, lay in enumerate(layouts):
            ys = [next(r[key] for r in rows if r["trace"] == t and r["layout"] == lay) for t in traces]
            ys = [100 * y for y in ys] if key == "waste_share" else ys
            ax.bar(x + j * wdt, ys, wdt, label=lay)
        ax.set_xticks(x + 0.4 - wdt / 2, traces)
        ax.set_title(label + (" (%)" if key == "waste_share" else ""))
        if key == "page_faults":
            ax.set_yscale("symlog")
    axes[0].legend(fontsize=8)
    fig.suptitle(f"Paged vs virtual KV layout, allocator replay at {args.budget_gib:g} GiB (SmolLM2 KV shape)")
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)


if __name__ == "__main__":
    main()
