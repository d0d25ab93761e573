"""``python -m pagedkv.cluster``: serve a prompts file or a trace on N engine replicas (Ray actors)
behind a KV-aware router, and write one JSON line per request.

Examples::

    python -m pagedkv.cluster --replicas 2 --prompts examples/prompts.jsonl --output target/cluster.jsonl
    python -m pagedkv.cluster --replicas 4 --trace benchmarks/data/mooncake_fast25/conversation_trace.jsonl \\
        --trace-limit 64 --trace-scale 0.01 --policy round_robin
    python -m pagedkv.cluster --address auto --replicas 8 --num-gpus 1 --prompts prompts.jsonl   # on a Ray cluster

Prompts and trace files use the formats of ``pagedkv-engine`` (see ``pagedkv-engine --help``).
Each output line: ``id``, ``replica``, ``attempts``, ``overlap_blocks`` (cached prefix blocks
on the chosen replica, as the router saw it), ``num_cached_tokens``, ``text``, ``token_ids``,
``finish_reason``, or ``error`` for a request the engine refused. Exit status: 0, 1 when every
request was refused, 2 for bad arguments or files, or a missing package of the ``ray`` extra
(Ray and the engine's packages: ``pip install "pagedkv[ray]"``).
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

from pagedkv.engine.cli_options import (
    add_block_size_option,
    add_model_options,
    add_sampling_basics,
    positive_float,
    positive_int,
)


def build_parser() -> argparse.ArgumentParser:
    """The ``python -m pagedkv.cluster`` / ``pagedkv-cluster`` argument parser."""
    from pagedkv import MAX_BLOCK_SIZE  # noqa: PLC0415

    ap = argparse.ArgumentParser(
        prog="python -m pagedkv.cluster",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__.split("\n\n", 1)[1],
    )
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompts", help="prompts file (.txt: one per line, or .jsonl)")
    src.add_argument("--trace", help="trace file of request lengths (synthetic prompts)")
    ap.add_argument("--trace-limit", type=positive_int, default=None, help="first N trace requests")
    ap.add_argument("--trace-scale", type=positive_float, default=1.0, help="multiply trace lengths (> 0)")
    ap.add_argument("--replicas", type=positive_int, default=2, help="engine replicas to start (>= 1)")
    ap.add_argument("--address", default=None, help="Ray cluster address (default: a local Ray cluster)")
    ap.add_argument("--num-cpus", type=float, default=1.0, help="Ray CPUs per replica")
    ap.add_argument("--num-gpus", type=float, default=0.0, help="Ray GPUs per replica")
    add_model_options(ap, where=" (the same path on every node)")
    ap.add_argument("--kv-blocks", type=positive_int, default=None, help="KV blocks per replica")
    add_block_size_option(ap, MAX_BLOCK_SIZE)
    add_sampling_basics(ap, max_tokens=64)
    ap.add_argument("--chat-template", action="store_true", help="apply the tokenizer's chat template")
    ap.add_argument("--policy", default="kv_aware", choices=["kv_aware", "round_robin", "least_loaded"])
    ap.add_argument("--overlap-weight", type=float, default=3.0, help="kv_aware: weight of the uncached share")
    ap.add_argument("--load-weight", type=float, default=1.0, help="kv_aware: weight of the relative load")
    ap.add_argument("--kv-weight", type=float, default=0.0, help="kv_aware: weight of the KV usage")
    ap.add_argument(
        "--prefill-weight",
        type=float,
        default=0.5,
        help="kv_aware: weight of queued prefill tokens (replicas report 0 for now)",
    )
    ap.add_argument(
        "--max-imbalance",
        type=float,
        default=1.25,
        help="kv_aware: skip replicas above max_imbalance * mean + 1 requests (0: no cap)",
    )
    ap.add_argument("--steps-per-call", type=positive_int, default=4, help="engine steps per replica round trip")
    ap.add_argument("--output", default=None, help="results JSONL (default: stdout)")
    return ap


def _fail(msg: str) -> int:
    print(f"pagedkv.cluster: {msg}", file=sys.stderr)
    return 2


def main(argv: list[str] | None = None) -> int:
    """Start the replicas, serve the prompts file or trace through the router, write one JSON
    line per request. Returns 0 when any request was answered, 1 when none was, 2 for a bad file
    or argument (argparse exits 2 itself for a bad flag value)."""
    args = build_parser().parse_args(argv)
    from pagedkv._optional import optional_imports  # noqa: PLC0415
    from pagedkv.errors import MissingDependencyError  # noqa: PLC0415

    # `pip install pagedkv` installs this command, not Ray or the engine the replicas run: say
    # so (and which extra brings both) before any file is read or a replica started.
    try:
        with optional_imports("pagedkv-cluster", "ray"):
            import ray  # noqa: F401, PLC0415

            from pagedkv.engine.sampling import SamplingParams  # noqa: PLC0415

            importlib.import_module("transformers")  # after torch: without torch it prints a warning
    except MissingDependencyError as e:
        return _fail(str(e))
    from pagedkv.cluster.cluster import ClusterRequest, ReplicaCluster  # noqa: PLC0415
    from pagedkv.engine.errors import EngineError, PromptFileError  # noqa: PLC0415
    from pagedkv.engine.inputs import read_prompts, read_trace, synthetic_prompt  # noqa: PLC0415
    from pagedkv.routing import policy_by_name  # noqa: PLC0415

    try:
        weights: dict[str, Any] = {}
        if args.policy == "kv_aware":
            weights = dict(
                overlap_weight=args.overlap_weight,
                load_weight=args.load_weight,
                kv_weight=args.kv_weight,
                prefill_weight=args.prefill_weight,
                max_imbalance=args.max_imbalance or None,
            )
        policy = policy_by_name(args.policy, **weights)
        base = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed)
        if args.prompts is not None:
            prompts = read_prompts(args.prompts)
            trace = None
        else:
            trace = read_trace(args.trace, limit=args.trace_limit, scale=args.trace_scale)
    except (PromptFileError, EngineError, ValueError) as e:
        return _fail(str(e))
    if args.output is not None:
        try:
            Path(args.output).parent.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            return _fail(f"--output {args.output}: {e}")

    engine_kwargs: dict[str, Any] = {"block_size": args.block_size, "dtype": args.dtype, "seed": args.seed}
    if args.kv_blocks is not None:
        engine_kwargs["num_kv_blocks"] = args.kv_blocks
    if args.device is not None:
        engine_kwargs["device"] = args.device
    t0 = time.perf_counter()
    try:
        cluster = ReplicaCluster(
            args.replicas,
            args.model,
            engine_kwargs=engine_kwargs,
            policy=policy,
            address=args.address,
            num_cpus=args.num_cpus,
            num_gpus=args.num_gpus,
            steps_per_call=args.steps_per_call,
        )
    except (EngineError, ValueError) as e:
        # A replica's engine refused --model / --device / --block-size... where it runs (the
        # driver may lack the replicas' GPU). Ray re-raises it as a subclass whose text is the
        # whole remote traceback; its `cause` is the engine's own error, one line.
        return _fail(str(getattr(e, "cause", None) or e))
    start_s = time.perf_counter() - t0
    if trace is not None:
        vocab = 32000
        requests = [
            ClusterRequest(
                str(i),
                synthetic_prompt(r.prompt_tokens, vocab, args.seed * 100003 + i),
                SamplingParams(
                    max_tokens=r.output_tokens, temperature=args.temperature, seed=args.seed, ignore_eos=True
                ),
            )
            for i, r in enumerate(trace)
        ]
    else:
        requests = []
        for i, p in enumerate(prompts):
            rid = str(p.get("id", i)) if isinstance(p, dict) else str(i)
            sp = base
            if isinstance(p, dict) and "max_tokens" in p:
                sp = SamplingParams(max_tokens=p["max_tokens"], temperature=args.temperature, seed=args.seed)
            requests.append(ClusterRequest(rid, p, sp, args.chat_template))
    t1 = time.perf_counter()
    results = cluster.serve(requests)
    serve_s = time.perf_counter() - t1
    out = open(args.output, "w") if args.output else sys.stdout
    try:
        for r in results.values():
            row: dict[str, Any] = {
                "id": r.request_id,
                "replica": r.replica,
                "attempts": r.attempts,
                "overlap_blocks": r.overlap_blocks,
            }
            if r.error is not None:
                row["error"] = r.error
            else:
                c = r.output.outputs[0]
                row.update(
                    num_cached_tokens=r.output.num_cached_tokens,
                    text=c.text,
                    token_ids=list(c.token_ids),
                    finish_reason=c.finish_reason,
                )
            out.write(json.dumps(row) + "\n")
    finally:
        if out is not sys.stdout:
            out.close()
    answered = [r for r in results.values() if r.error is None]
    prompt_toks = sum(len(r.output.prompt_token_ids) for r in answered)
    cached = sum(r.output.num_cached_tokens for r in answered)
    per = Counter(r.replica for r in results.values())
    print(
        f"pagedkv.cluster: {len(results)} requests on {args.replicas} replicas ({args.policy}) in "
        f"{serve_s:.1f} s (start {start_s:.1f} s); per replica {dict(sorted(per.items()))}; "
        f"prefix hit {100 * cached / max(prompt_toks, 1):.1f}% of {prompt_toks} prompt tokens; "
        f"dead replicas {cluster.dead}",
        file=sys.stderr,
    )
    cluster.shutdown()
    return 1 if not answered else 0
