"""What the engine's cache identity costs (``pagedkv.engine.models.identity``), on SmolLM2-135M-Instruct.

Prints, best of ``--repeat`` runs each:

- the weights digest (SHA-256 over the config and every tensor of the loaded state dict), the
  tokenizer and chat-template digests, and the whole identity -- paid at engine start;
- the cached weights digest (a hit in the digest cache keyed by the files' paths, sizes and
  mtimes) -- what later starts on the same files pay;
- prefix hashing of a long prompt with an empty chain seed and with the identity as the seed,
  side by side: the seed is folded once into the chain root, so the per-block cost is unchanged.

Usage:
  python benchmarks/cache_identity.py [--repeat 3] [--tokens 65536]
"""

from __future__ import annotations

import argparse
import os
import time
import warnings
from collections.abc import Callable
from typing import Any


def best_of(repeat: int, fn: Callable[[], Any]) -> float:
    """Smallest wall time of ``repeat`` calls, seconds."""
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeat", type=int, default=3, help="runs per figure (best is shown)")
    ap.add_argument("--tokens", type=int, default=65536, help="prompt length for the hashing figure")
    args = ap.parse_args()

    import torch

    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    import pagedkv
    from pagedkv.engine.models.identity import (
        CacheIdentity,
        cached_weights_digest,
        chat_template_digest,
        tokenizer_digest,
        weights_digest,
    )
    from pagedkv.engine.models.loader import load_hf_model
    from pagedkv.engine.models.rope import rope_parameters

    hf, tok = load_hf_model(None, dtype=torch.float32)
    unique = {t.data_ptr(): t for t in hf.state_dict().values()}  # a tied LM head is hashed once
    nbytes = sum(t.numel() * t.element_size() for t in unique.values())
    ident = CacheIdentity.of_engine_inputs(hf, tok, kv_dtype=torch.float32, rope=rope_parameters(hf.config))
    cached_weights_digest(hf, None, torch.float32)  # fill the digest cache
    rows = [
        ("weights digest", best_of(args.repeat, lambda: weights_digest(hf))),
        ("tokenizer digest", best_of(args.repeat, lambda: tokenizer_digest(tok))),
        ("chat template digest", best_of(args.repeat, lambda: chat_template_digest(tok))),
        (
            "whole identity",
            best_of(
                args.repeat,
                lambda: CacheIdentity.of_engine_inputs(
                    hf, tok, kv_dtype=torch.float32, rope=rope_parameters(hf.config)
                ),
            ),
        ),
        ("cached weights digest (hit)", best_of(args.repeat, lambda: cached_weights_digest(hf, None, torch.float32))),
    ]
    prompt = list(range(args.tokens))
    plain = pagedkv.KVIndexer(16)
    seeded = pagedkv.KVIndexer(16, hash_seed=ident.seed)
    hash_rows = [
        ("prefix hashes, empty seed", best_of(args.repeat, lambda: plain.block_hashes(prompt))),
        ("prefix hashes, identity seed", best_of(args.repeat, lambda: seeded.block_hashes(prompt))),
    ]
    load = os.getloadavg()
    print(
        f"SmolLM2-135M-Instruct: {len(hf.state_dict())} tensors, {nbytes / 2**20:.0f} MiB fp32 hashed; "
        f"identity {ident.digest[:16]}"
    )
    print(f"load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}; torch threads 1; best of {args.repeat}")
    print(f"| {'step':<30} | {'time':>10} |")
    print(f"|{'-' * 32}|{'-' * 12}|")
    for name, secs in rows:
        print(f"| {name:<30} | {secs * 1e3:>7.1f} ms |")
    blocks = args.tokens // 16
    for name, secs in hash_rows:
        print(f"| {name:<30} | {secs / blocks * 1e9:>7.0f} ns | per 16-token block ({blocks} blocks)")
    print(f"weights digest throughput: {nbytes / rows[0][1] / 2**30:.2f} GiB/s")


if __name__ == "__main__":
    main()
