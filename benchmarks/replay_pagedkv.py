"""Replay the allocator operation trace through pagedkv's Python API.

Run by ``allocator_speed.py`` in a subprocess: ``python replay_pagedkv.py --trace-file T --out
R.json [--hash-algo sha256|xxh3_128]``. Per step: one batched ``KVCacheManager.step`` for the
running requests (one decode token each, the tokens they sampled last step passed as a 1-D int64
array: the binding's decode fast path), then ``add_sequence`` for each admitted request (its
prompt as an int64 numpy array) and one batched ``step`` for their whole prompts, then ``free``
for the finished ones. So two crossings into Rust per step, plus one per new / finished request. ``step`` also builds the slot mapping and
block tables of the batch (what the model runner needs), which the other systems' managers
leave to their model runners.
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np

from replay_common import OpTrace, Replayer, main


class PagedKVReplayer(Replayer):
    """pagedkv's KVCacheManager (Rust core behind PyO3; batched steps, GIL released)."""

    name = "pagedkv"

    def __init__(self, hash_algo: str) -> None:
        import pagedkv  # noqa: PLC0415

        self.pagedkv = pagedkv
        self.hash_algo = hash_algo

    def version(self) -> dict[str, Any]:
        import subprocess  # noqa: PLC0415
        from pathlib import Path  # noqa: PLC0415

        root = Path(__file__).resolve().parent.parent
        r = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True)
        return {"version": getattr(self.pagedkv, "__version__", "unknown"), "commit": r.stdout.strip() or None,
                "hash": self.hash_algo, "python": sys.version.split()[0]}

    def prepare(self, trace: OpTrace, prompts: list[Any], outputs: list[Any]) -> None:
        cfg = self.pagedkv.CacheConfig(trace.num_blocks, trace.block_size, enable_prefix_caching=True,
                                       hash_algo=self.hash_algo)
        self.mgr = self.pagedkv.KVCacheManager(cfg)
        self.prompts = prompts
        self.outputs = outputs
        self.prompt_lens = trace.prompt_lens
        self.sampled: dict[int, int] = {}
        self.cached_tokens = 0

    def step(self, t: int, admit: list[int], decode: list[int], finish: list[int]) -> None:
        mgr = self.mgr
        sampled = self.sampled
        outputs = self.outputs
        if decode:
            # Decode batch: one token per sequence as a 1-D array (the binding's fast path).
            toks = np.fromiter((outputs[r][sampled[r]] for r in decode), np.int64, len(decode))
            out = mgr.step(np.array(decode, dtype=np.uint64), 1, toks)
            if out.error is not None:
                raise RuntimeError(f"pagedkv decode step {t} failed: {out.error!r}")
            for r in decode:
                sampled[r] += 1
        if admit:
            for r in admit:
                mgr.add_sequence(r, self.prompts[r])
            out = mgr.step(admit, [self.prompt_lens[r] for r in admit])
            if out.error is not None:
                raise RuntimeError(f"pagedkv prefill step {t} failed: {out.error!r}")
            self.cached_tokens += int(out.num_cached_tokens.sum())
            for r in admit:
                sampled[r] = 0
        for r in finish:
            mgr.free(r)
            del sampled[r]

    def pool_adapter(self, num_blocks: int) -> Any:
        """pagedkv.BlockPool (Rust, GIL released per call), batch allocate / free of int32 ids."""
        pool = self.pagedkv.BlockPool(num_blocks)

        class _Pool:
            allocate = staticmethod(pool.allocate)
            free = staticmethod(pool.free)

            @staticmethod
            def concat_reversed(parts: list[Any]) -> Any:
                return np.concatenate(parts)[::-1]

        return _Pool()

    def counters(self) -> dict[str, Any]:
        self.mgr.check_invariants()
        return {"cached_prompt_tokens": self.cached_tokens, "blocks_in_use_at_end": self.mgr.pool.num_used}


def _factory(args):
    return PagedKVReplayer(args.hash_algo or "sha256"), "numpy"


if __name__ == "__main__":
    main(_factory)
