"""Blocks saved by sharing for parallel sampling and beam search, after Fig. 15 of the
PagedAttention paper (Kwon et al., SOSP'23; OPT-13B on Alpaca: parallel sampling saves 6.09 /
8.53 / 9.79% of blocks at n = 2 / 4 / 6, beam search 37.56 / 53.13 / 55.16% at width 2 / 4 / 6).

Saving = 1 - (physical blocks in use) / (blocks the same sequences would hold without sharing),
both summed over every step of the run (a time average weighted by memory, as the paper's
"memory saving"). Physical blocks are the pool's ``num_used``; the unshared count is
``sum(ceil(kv_tokens / block_size))`` over live sequences.

- Parallel sampling: Alpaca-like lengths (log-normal, paper means 19.31 prompt / 58.45 output
  tokens); each request's prompt is prefilled once, then ``fork``-ed into n samples, each with
  its own output length drawn from the same distribution; the first write into the shared,
  partially filled prompt block triggers copy-on-write. Continuous batching through pagedkv's
  Python API (``add_sequence`` / ``step`` / ``fork`` / ``free``).
- Beam search (``--beam-source``):
  ``engine`` (``auto`` picks it when the engine and its default model load): the pagedkv reference
  engine on SmolLM2-135M-Instruct (fp32, CPU) running real beam search (transformers-equivalent)
  over short Alpaca-style instructions written for this benchmark (chat template on, EOS on,
  at most 64 new tokens); ``simulated``: beam search over random
  log-probabilities (every beam's next-token log-probs drawn i.i.d. from a log-softmax of
  Gaussian logits, std ``--logit-std``, over ``--vocab`` tokens) replayed through the manager:
  each step the k best (beam, token) candidates survive, a parent chosen m times is forked
  m - 1 times and a parent never chosen is freed; every beam runs to the request's output
  length. The table says which source produced each row.

Usage: ``python benchmarks/sharing.py [--quick] [--beam-source simulated|engine|auto]``
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import deque
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402

PAPER_PARALLEL = {2: 6.09, 4: 8.53, 6: 9.79}
PAPER_BEAM = {2: 37.56, 4: 53.13, 6: 55.16}


class _Meter:
    """Sums physical and unshared block counts over steps."""

    def __init__(self, pool: Any, bs: int) -> None:
        self.pool = pool
        self.bs = bs
        self.physical = 0
        self.logical = 0
        self.steps = 0
        self.peak_physical = 0
        self.peak_logical = 0

    def sample(self, kv_tokens: Any) -> None:
        phys = self.pool.num_used
        log = sum(-(-t // self.bs) for t in kv_tokens)
        self.physical += phys
        self.logical += log
        self.steps += 1
        self.peak_physical = max(self.peak_physical, phys)
        self.peak_logical = max(self.peak_logical, log)

    def saving(self) -> float:
        return 1 - self.physical / self.logical if self.logical else 0.0


def _manager(num_blocks: int, bs: int):
    import pagedkv  # noqa: PLC0415

    # Prefix caching off: only fork sharing is measured (prompts are unique anyway).
    return pagedkv.KVCacheManager(
        pagedkv.CacheConfig(num_blocks=num_blocks, block_size=bs, enable_prefix_caching=False)
    )


def parallel_sampling(n: int, requests: int, *, bs: int = 16, max_running: int = 64, seed: int = 0) -> dict[str, Any]:
    """Parallel sampling with ``n`` samples per request (see module docstring)."""
    rng = np.random.default_rng(seed)
    mi, mo = common.PAPER_LENGTH_MEANS["alpaca"]
    prompts = common.lognormal_lengths(rng, requests, mi, 1.0, 1024).tolist()
    outs = common.lognormal_lengths(rng, requests * n, mo, 1.0, 1024).reshape(requests, n).tolist()
    mgr = _manager(max_running * n * (2048 // bs + 2) + 1, bs)  # lengths are <= 1024 + 1024
    meter = _Meter(mgr.pool, bs)
    waiting = deque(range(requests))
    live: dict[int, list[int]] = {}  # seq id -> [request, sample, tokens sampled, kv tokens]
    copies = 0
    while waiting or live:
        ids, num_new, app = [], [], []
        for sid, s in live.items():
            ids.append(sid)
            num_new.append(1)
            app.append([_tok(sid, s[2] - 1)])
        groups = len({s[0] for s in live.values()})
        admitted = []
        while waiting and groups + len(admitted) < max_running:
            r = waiting.popleft()
            sid = r * 16  # sample j of request r is seq r*16 + j
            mgr.add_sequence(sid, common.unique_tokens(r, prompts[r]))
            admitted.append(r)
            ids.append(sid)
            num_new.append(prompts[r])
            app.append([])
        out = mgr.step(ids, num_new, app)
        if out.error is not None:
            raise RuntimeError(f"pagedkv step failed: {out.error!r}")
        copies += len(out.copies)
        for s in live.values():
            s[2] += 1
            s[3] += 1
        for r in admitted:
            base = r * 16
            live[base] = [r, 0, 1, prompts[r]]
            for j in range(1, n):  # the prompt's blocks are shared by all n samples
                mgr.fork(base, base + j)
                live[base + j] = [r, j, 1, prompts[r]]
        meter.sample([s[3] for s in live.values()])
        for sid in [sid for sid, s in live.items() if s[2] == outs[s[0]][s[1]]]:
            mgr.free(sid)
            del live[sid]
    mgr.check_invariants()
    return {
        "mode": "parallel sampling",
        "k": n,
        "saving": meter.saving(),
        "steps": meter.steps,
        "copies": copies,
        "peak_physical_blocks": meter.peak_physical,
        "peak_unshared_blocks": meter.peak_logical,
        "source": "pagedkv manager, Alpaca-like lengths",
    }


def _tok(sid: int, k: int) -> int:
    # Sampled token k of sequence sid: distinct across sequences (samples diverge).
    return int((sid * 7919 + k * 104729 + 17) % 32000)


def beam_search_simulated(
    width: int,
    requests: int,
    *,
    bs: int = 16,
    vocab: int = 1000,
    logit_std: float = 3.0,
    seed: int = 0,
    max_running: int = 16,
) -> dict[str, Any]:
    """Beam search of width ``width`` over random log-probabilities, replayed through the
    manager's fork / copy-on-write / free (see module docstring)."""
    rng = np.random.default_rng(seed)
    mi, mo = common.PAPER_LENGTH_MEANS["alpaca"]
    prompts = common.lognormal_lengths(rng, requests, mi, 1.0, 1024).tolist()
    outs = common.lognormal_lengths(rng, requests, mo, 1.0, 1024).tolist()
    mgr = _manager(max_running * width * (2048 // bs + 2) + 1, bs)
    meter = _Meter(mgr.pool, bs)
    next_sid = 1
    waiting = deque(range(requests))
    # Per active request: beams as [seq id, score, pending token (None right after prefill), kv tokens]
    active: dict[int, dict[str, Any]] = {}
    copies = 0
    while waiting or active:
        ids, num_new, app = [], [], []
        for st in active.values():
            for b in st["beams"]:
                ids.append(b[0])
                num_new.append(1)
                app.append([b[2]])
        admitted = []
        while waiting and len(active) + len(admitted) < max_running:
            r = waiting.popleft()
            sid = next_sid
            next_sid += 1
            mgr.add_sequence(sid, common.unique_tokens(r, prompts[r]))
            admitted.append((r, sid))
            ids.append(sid)
            num_new.append(prompts[r])
            app.append([])
        out = mgr.step(ids, num_new, app)
        if out.error is not None:
            raise RuntimeError(f"pagedkv step failed: {out.error!r}")
        copies += len(out.copies)
        for st in active.values():
            for b in st["beams"]:
                b[3] += 1
        for r, sid in admitted:
            active[r] = {"beams": [[sid, 0.0, None, prompts[r]]], "steps": 0}
        meter.sample([b[3] for st in active.values() for b in st["beams"]])
        # Selection: every beam proposes its `width` best next tokens; keep the best `width`.
        for r in list(active):
            st = active[r]
            st["steps"] += 1
            beams = st["beams"]
            if st["steps"] >= outs[r]:
                for b in beams:
                    mgr.free(b[0])
                del active[r]
                continue
            logits = rng.normal(0.0, logit_std, size=(len(beams), vocab))
            logp = logits - np.logaddexp.reduce(logits, axis=1, keepdims=True)
            cand = (np.array([b[1] for b in beams])[:, None] + logp).ravel()
            top = np.argpartition(-cand, width - 1)[:width]
            top = top[np.argsort(-cand[top])]
            parents = [int(i) // vocab for i in top]
            chosen: dict[int, int] = {}
            new_beams = []
            for i, pidx in zip(top, parents):
                parent = beams[pidx]
                if pidx not in chosen:
                    chosen[pidx] = 1
                    sid = parent[0]
                else:  # another child of the same parent shares its blocks
                    sid = next_sid
                    next_sid += 1
                    mgr.fork(parent[0], sid)
                new_beams.append([sid, float(cand[i]), int(i) % vocab, parent[3]])
            for pidx, b in enumerate(beams):
                if pidx not in chosen:
                    mgr.free(b[0])
            st["beams"] = new_beams
    mgr.check_invariants()
    if mgr.pool.num_used:
        raise AssertionError(f"{mgr.pool.num_used} blocks leaked")
    return {
        "mode": "beam search",
        "k": width,
        "saving": meter.saving(),
        "steps": meter.steps,
        "copies": copies,
        "peak_physical_blocks": meter.peak_physical,
        "peak_unshared_blocks": meter.peak_logical,
        "source": f"simulated beam search (random log-probs, std {logit_std}, vocab {vocab}) via pagedkv manager",
    }


#: Short Alpaca-style instructions written for this benchmark (Alpaca prompts average ~19 tokens).
INSTRUCTIONS = [
    "Give three tips for staying healthy.",
    "Describe the water cycle in two sentences.",
    "Explain why the sky is blue.",
    "Write a haiku about autumn leaves.",
    "Name three primary colors.",
    "Suggest a name for a small bakery.",
    "Summarize the plot of Cinderella.",
    "List four uses for a paper clip.",
    "Explain what a prime number is.",
    "Give an example of a renewable energy source.",
    "Describe a cat to someone who has never seen one.",
    "Translate 'good morning' into French and Spanish.",
    "Write a short thank-you note to a teacher.",
    "What is the capital of Japan?",
    "Explain how a bicycle works.",
    "Give two reasons to learn a second language.",
    "Write a one-sentence story about a robot.",
    "Describe the taste of a lemon.",
    "List the planets closest to the sun.",
    "Explain what photosynthesis does for a plant.",
    "Suggest a healthy breakfast.",
    "Why do we have seasons?",
    "Write a slogan for a recycling campaign.",
    "Explain the difference between weather and climate.",
]


def beam_search_engine(
    width: int, requests: int, *, bs: int = 16, max_tokens: int = 64, engine_model: Any = None, **_: Any
) -> dict[str, Any]:
    """Beam search of width ``width`` on the pagedkv reference engine (``pagedkv.engine``,
    default model SmolLM2-135M-Instruct, fp32 CPU, chat template, greedy beam search, EOS on,
    ``max_tokens`` new tokens at most, prefix caching off so only beam sharing counts).

    Blocks are counted just before each model forward (after the step's allocations and
    copy-on-write): physical = the pool's blocks in use, unshared = the sum of the live
    sequences' block-table lengths. ``engine_model`` is an already loaded ``(model, tokenizer)``
    pair to reuse. Raises RuntimeError when the engine cannot be imported or loaded.
    """
    try:
        from pagedkv.engine import SamplingParams  # noqa: PLC0415
        from pagedkv.engine.models.loader import load_hf_model  # noqa: PLC0415
    except Exception as e:  # noqa: BLE001 - any failure means "engine not usable here"
        raise RuntimeError(f"pagedkv.engine not importable: {e}") from e
    try:
        model, tok = engine_model or load_hf_model()
    except Exception as e:  # noqa: BLE001
        raise RuntimeError(f"default model not loadable: {e}") from e
    prompts = [INSTRUCTIONS[i % len(INSTRUCTIONS)] for i in range(requests)]
    eng, meter = _metered_engine(model, tok, requests * width * (-(-(128 + max_tokens) // bs)) + 64, bs)
    mgr = eng.manager
    before = mgr.stats().copies
    outs = eng.generate(prompts, SamplingParams(beam_width=width, max_tokens=max_tokens), chat_template=True)
    copies = mgr.stats().copies - before
    mgr.check_invariants()
    if mgr.pool.num_used:
        raise AssertionError(f"{mgr.pool.num_used} blocks leaked by the engine")
    out_lens = [len(o.outputs[0].token_ids) for o in outs]
    prompt_lens = [len(o.prompt_token_ids) for o in outs]
    return {
        "mode": "beam search",
        "k": width,
        "saving": meter.saving(),
        "steps": meter.steps,
        "copies": copies,
        "peak_physical_blocks": meter.peak_physical,
        "peak_unshared_blocks": meter.peak_logical,
        "prompt_tokens_mean": float(np.mean(prompt_lens)),
        "output_tokens_mean": float(np.mean(out_lens)),
        "example_output": outs[0].outputs[0].text[:200],
        "source": f"pagedkv.engine, SmolLM2-135M-Instruct (fp32 CPU), {requests} instructions, "
        f"max {max_tokens} new tokens",
    }


def _metered_engine(model: Any, tok: Any, num_kv_blocks: int, bs: int) -> tuple[Any, _Meter]:
    """An engine (prefix caching off: only fork sharing counts) whose model runner samples the
    block counts just before each forward, prefill and decode steps alike: physical = the
    pool's blocks in use, unshared = the sum of the live running sequences' block-table lengths
    (what each would hold without sharing)."""
    from pagedkv.engine import LLMEngine  # noqa: PLC0415

    eng = LLMEngine(model, tokenizer=tok, num_kv_blocks=num_kv_blocks, block_size=bs, enable_prefix_caching=False)
    mgr = eng.manager
    meter = _Meter(mgr.pool, bs)
    orig = eng.runner.execute

    def execute(batch: Any) -> Any:
        tables = [
            len(mgr.block_table(s.seq_id))
            for r in eng.requests
            for s in r.seqs
            if mgr.num_tokens(s.seq_id) and mgr.status(s.seq_id) == "running"
        ]
        phys = mgr.pool.num_used
        meter.physical += phys
        meter.logical += sum(tables)
        meter.steps += 1
        meter.peak_physical = max(meter.peak_physical, phys)
        meter.peak_logical = max(meter.peak_logical, sum(tables))
        return orig(batch)

    eng.runner.execute = execute
    return eng, meter


def parallel_sampling_engine(
    n: int,
    requests: int,
    *,
    bs: int = 16,
    max_tokens: int = 64,
    temperature: float = 0.8,
    arrivals_per_step: float = 0.25,
    seed: int = 0,
    engine_model: Any = None,
    **_: Any,
) -> dict[str, Any]:
    """Parallel sampling with ``n`` samples per request served by the pagedkv reference engine
    (SmolLM2-135M-Instruct, fp32 CPU, chat template, EOS on, ``temperature``, at most
    ``max_tokens`` new tokens per sample): the paper's measurement (Fig. 15), a served workload
    with arrivals whose memory is counted in every step, prefill and decode.

    Requests arrive by a Poisson process of ``arrivals_per_step`` requests per engine step (the
    first at step 0) and join the running batch as they come; the engine prefills each prompt
    once and forks it into ``n`` samples that share its blocks (copy-on-write on the partially
    filled last prompt block). Blocks are counted as in :func:`beam_search_engine`. Raises
    RuntimeError when the engine cannot be imported or loaded.
    """
    try:
        from pagedkv.engine import SamplingParams  # noqa: PLC0415
        from pagedkv.engine.models.loader import load_hf_model  # noqa: PLC0415
    except Exception as e:  # noqa: BLE001 - any failure means "engine not usable here"
        raise RuntimeError(f"pagedkv.engine not importable: {e}") from e
    try:
        model, tok = engine_model or load_hf_model()
    except Exception as e:  # noqa: BLE001
        raise RuntimeError(f"default model not loadable: {e}") from e
    rng = np.random.default_rng(seed)
    arrive = np.concatenate(([0.0], np.cumsum(rng.exponential(1.0 / arrivals_per_step, requests - 1))))
    prompts = [INSTRUCTIONS[i % len(INSTRUCTIONS)] for i in range(requests)]
    eng, meter = _metered_engine(model, tok, requests * n * (-(-(128 + max_tokens) // bs)) + 64, bs)
    mgr = eng.manager
    before = mgr.stats().copies
    outs: list[Any] = []
    nxt, t = 0, 0
    while nxt < requests or eng.has_unfinished():
        while nxt < requests and arrive[nxt] <= t:
            eng.add_request(
                prompts[nxt],
                SamplingParams(n=n, temperature=temperature, seed=seed + nxt, max_tokens=max_tokens),
                chat_template=True,
            )
            nxt += 1
        if eng.has_unfinished():
            outs.extend(eng.step())
        t += 1
    copies = mgr.stats().copies - before
    mgr.check_invariants()
    if mgr.pool.num_used:
        raise AssertionError(f"{mgr.pool.num_used} blocks leaked by the engine")
    out_lens = [len(c.token_ids) for o in outs for c in o.outputs]
    prompt_lens = [len(o.prompt_token_ids) for o in outs]
    return {
        "mode": "parallel sampling",
        "k": n,
        "saving": meter.saving(),
        "steps": meter.steps,
        "copies": copies,
        "peak_physical_blocks": meter.peak_physical,
        "peak_unshared_blocks": meter.peak_logical,
        "prompt_tokens_mean": float(np.mean(prompt_lens)),
        "output_tokens_mean": float(np.mean(out_lens)),
        "engine_steps": t,
        "arrivals_per_step": arrivals_per_step,
        "source": f"pagedkv.engine, SmolLM2-135M-Instruct (fp32 CPU), {requests} instructions arriving "
        f"{arrivals_per_step:g}/step, temperature {temperature:g}, max {max_tokens} new tokens",
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=1000, help="requests per configuration")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--ks", nargs="+", type=int, default=[2, 4, 6], help="samples n / beam widths")
    ap.add_argument(
        "--beam-source",
        choices=["auto", "engine", "simulated"],
        default="auto",
        help="auto: the engine when it offers beam search, else simulated",
    )
    ap.add_argument(
        "--beam-requests", type=int, default=None, help="prompts for engine beam search (default 24, 8 with --quick)"
    )
    ap.add_argument("--torch-threads", type=int, default=1, help="torch intra-op threads for the engine")
    ap.add_argument("--beam-max-tokens", type=int, default=64, help="max new tokens per beam search request")
    ap.add_argument("--logit-std", type=float, default=3.0)
    ap.add_argument("--vocab", type=int, default=1000)
    ap.add_argument("--quick", action="store_true", help="300 parallel-sampling requests, 8 beam prompts")
    ap.add_argument("--results-dir", default=str(common.RESULTS_DIR))
    a = ap.parse_args(argv)
    if a.quick:
        a.requests = min(a.requests, 300)
    beam_requests = a.beam_requests or (8 if a.quick else len(INSTRUCTIONS))
    jobs = [("parallel", k) for k in a.ks] + [("beam", k) for k in a.ks]
    if a.beam_source in ("auto", "engine"):
        # The engine's parallel sampling (the paper's method) next to the length simulation.
        jobs += [("parallel-simulated", k) for k in a.ks]
    results: list[dict[str, Any]] = []
    notes: list[str] = []
    engine_model = None
    use_engine = a.beam_source in ("auto", "engine")
    if use_engine:
        try:
            import torch  # noqa: PLC0415

            # One intra-op thread: on a shared 2-core machine torch's OpenMP threads spin
            # against other processes (measured ~12x slower with 2 threads under load).
            torch.set_num_threads(a.torch_threads)
            from pagedkv.engine.models.loader import load_hf_model  # noqa: PLC0415

            engine_model = load_hf_model()
        except Exception as e:  # noqa: BLE001 - any failure means "engine not usable here"
            if a.beam_source == "engine":
                raise
            use_engine = False
            notes.append(f"engine beam search unavailable ({type(e).__name__}: {e}); beam rows are simulated")
            print(notes[-1], file=sys.stderr)
    bar = common.progress(total=len(jobs), desc="sharing")
    for mode, k in jobs:
        t0 = time.perf_counter()
        if mode == "parallel-simulated" and not use_engine:
            bar.update(1)  # the engine did not load: the "parallel" rows are simulated already
            continue
        if mode == "parallel-simulated" or (mode == "parallel" and not use_engine):
            r = parallel_sampling(k, a.requests, bs=a.block_size)
            if use_engine:
                r["mode"] = "parallel sampling, simulated lengths"
        elif mode == "parallel":
            r = parallel_sampling_engine(
                k, beam_requests, bs=a.block_size, max_tokens=a.beam_max_tokens, engine_model=engine_model
            )
        elif use_engine:
            r = beam_search_engine(
                k, beam_requests, bs=a.block_size, max_tokens=a.beam_max_tokens, engine_model=engine_model
            )
        else:
            r = beam_search_simulated(k, a.requests, bs=a.block_size, vocab=a.vocab, logit_std=a.logit_std)
        r["seconds"] = time.perf_counter() - t0
        r["paper_saving_pct"] = (PAPER_BEAM if mode == "beam" else PAPER_PARALLEL).get(k)
        results.append(r)
        bar.update(1)
    bar.close()
    rows = [
        [
            r["mode"],
            r["k"],
            100 * r["saving"],
            r["paper_saving_pct"],
            r["copies"],
            r["peak_physical_blocks"],
            r["peak_unshared_blocks"],
            r["source"],
        ]
        for r in results
    ]
    common.print_table(
        f"Blocks saved by sharing (pagedkv, block size {a.block_size})",
        [
            "mode",
            "n / width",
            "saved %",
            "paper % (OPT-13B, Alpaca)",
            "COW copies",
            "peak blocks",
            "peak blocks unshared",
            "source",
        ],
        rows,
        footnote="saved = 1 - physical blocks / unshared blocks, summed over all steps. " + " ".join(notes),
    )
    payload = {
        "description": __doc__.split("\n\n")[0],
        "notes": notes,
        "settings": {
            "requests": a.requests,
            "beam_requests": beam_requests,
            "block_size": a.block_size,
            "pagedkv_version": common.pagedkv_version(),
        },
        "paper_fig15": {"parallel": PAPER_PARALLEL, "beam": PAPER_BEAM},
        "results": results,
    }
    path = common.write_json("sharing", payload, Path(a.results_dir))
    png = plot(results, Path(a.results_dir) / "sharing.png")
    print(f"wrote {path} and {png}")
    return payload


def plot(results: list[dict[str, Any]], path: Path) -> Path:
    """Measured vs paper saving, one panel per mode."""
    plt = common.pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, mode, paper in ((axes[0], "parallel sampling", PAPER_PARALLEL), (axes[1], "beam search", PAPER_BEAM)):
        rows = [r for r in results if r["mode"] == mode]
        ks = [r["k"] for r in rows]
        x = np.arange(len(ks))
        ax.bar(x - 0.2, [100 * r["saving"] for r in rows], 0.4, label="pagedkv (measured)")
        ax.bar(x + 0.2, [paper.get(k, 0) for k in ks], 0.4, label="paper (OPT-13B)", color="#adb5bd")
        ax.set_xticks(x)
        ax.set_xticklabels([str(k) for k in ks])
        ax.set_xlabel("samples n" if mode == "parallel sampling" else "beam width")
        ax.set_ylabel("blocks saved %")
        src = rows[0]["source"].split(" (")[0] if rows else ""
        ax.set_title(f"{mode}\n({src})", fontsize=9)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


if __name__ == "__main__":
    main()
